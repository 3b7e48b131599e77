//! The mock engine over real HTTP on loopback: caching and timing, rank targeting, streaming, load, aborts.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dprouter_mock_engine::{serve, Api, Engine, EngineConfig, Faults};
use dprouter_sim::CostModel;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

struct Server {
    addr: SocketAddr,
    engine: Arc<Engine>,
    client: HttpClient,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(config: EngineConfig) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let engine = Engine::new(config);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, Arc::clone(&engine), async {
        let _ = stopped.await;
    }));
    Server {
        addr,
        engine,
        client: Client::builder(TokioExecutor::new()).build_http(),
        _stop: stop,
    }
}

fn config(dp: u32, preset: &str, time_scale: f64) -> EngineConfig {
    EngineConfig {
        dp_size: dp,
        cost: CostModel::preset(preset).unwrap(),
        time_scale,
        ..EngineConfig::default()
    }
}

impl Server {
    async fn send(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Response<Incoming> {
        let mut req = Request::post(format!("http://{}{path}", self.addr)).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        self.client
            .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await
            .unwrap()
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Value) -> (StatusCode, Option<u64>, Value) {
        let resp = self.send(path, headers, &body).await;
        let status = resp.status();
        let rank = resp
            .headers()
            .get("x-dp-rank")
            .map(|v| v.to_str().unwrap().parse().unwrap());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, rank, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> Value {
        let resp = self
            .client
            .get(format!("http://{}{path}", self.addr).parse().unwrap())
            .await
            .unwrap();
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
    }

    /// Streams a request; returns the time to the first data event and every event's JSON (without `[DONE]`).
    async fn stream(&self, path: &str, body: Value) -> (Duration, Vec<Value>) {
        let started = Instant::now();
        let mut resp = self.send(path, &[], &body).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let mut first = None;
        let mut text = String::new();
        while let Some(frame) = resp.body_mut().frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                first.get_or_insert_with(|| started.elapsed());
                text.push_str(std::str::from_utf8(&data).unwrap());
            }
        }
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let events = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        (first.unwrap(), events)
    }
}

fn long_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 31 % 150_000).collect()
}

#[tokio::test]
async fn same_prefix_on_the_same_rank_is_cached_and_faster() {
    // h100-8b at half speed: a cold 20k-token prefill takes ~0.41 s, a warm one ~15 ms.
    let s = start(config(2, "h100-8b", 0.5)).await;
    let prefix = long_prompt(20_000);
    let body = |tail: u32, rank: u32| {
        let mut ids = prefix.clone();
        ids.extend([tail, tail + 1]);
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "stream": true, "routed_dp_rank": rank})
    };
    let (cold, events) = s.stream("/generate", body(1, 0)).await;
    assert_eq!(events.last().unwrap()["meta_info"]["cached_tokens"], 0);
    let (warm, events) = s.stream("/generate", body(7, 0)).await;
    let meta = &events.last().unwrap()["meta_info"];
    assert_eq!(
        (meta["dp_rank"].as_u64(), meta["prompt_tokens"].as_u64()),
        (Some(0), Some(20_002))
    );
    assert!(meta["cached_tokens"].as_u64().unwrap() >= 20_000, "{meta}");
    assert!(warm * 3 < cold, "warm TTFT {warm:?} vs cold {cold:?}");
    let (_, events) = s.stream("/generate", body(9, 1)).await;
    assert_eq!(
        events.last().unwrap()["meta_info"]["cached_tokens"],
        0,
        "rank 1 has its own cache"
    );
}

#[tokio::test]
async fn chat_turns_reuse_the_previous_turn_and_report_cached_tokens() {
    let s = start(config(1, "zero", 1.0)).await;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful assistant. ".repeat(50)}),
        json!({"role": "user", "content": "hello"}),
    ];
    let (status, _, first) = s
        .post(
            "/v1/chat/completions",
            &[],
            json!({"messages": messages, "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "and then?"}));
    let (_, _, second) = s
        .post(
            "/v1/chat/completions",
            &[],
            json!({"messages": messages, "max_tokens": 8}),
        )
        .await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The whole first prompt and all but the last answer token are reused.
    assert!(cached >= prompt1 + 6, "cached {cached}, first prompt {prompt1}");
}

#[tokio::test]
async fn rank_targeting_follows_sglang() {
    let s = start(config(4, "zero", 1.0)).await;
    let gen = |extra: Value| {
        let mut b = json!({"text": "hi", "sampling_params": {"max_new_tokens": 1}});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    // Without an override the engine's own round robin starts at rank 0.
    let ranks: Vec<_> = futures_collect(&s, (0..4).map(|_| gen(json!({})))).await;
    assert_eq!(ranks, vec![Some(0), Some(1), Some(2), Some(3)]);
    assert_eq!(
        s.post("/generate", &[], gen(json!({"routed_dp_rank": 2}))).await.1,
        Some(2)
    );
    assert_eq!(
        s.post("/generate", &[], gen(json!({"data_parallel_rank": 3}))).await.1,
        Some(3)
    );
    assert_eq!(
        s.post(
            "/generate",
            &[],
            gen(json!({"routed_dp_rank": 1, "data_parallel_rank": 3}))
        )
        .await
        .1,
        Some(1)
    );
    // /generate ignores the header; /v1/* honours it over the body.
    assert_eq!(
        s.post(
            "/generate",
            &[("X-Data-Parallel-Rank", "3")],
            gen(json!({"routed_dp_rank": 1}))
        )
        .await
        .1,
        Some(1)
    );
    let completion = json!({"prompt": "hi", "max_tokens": 1, "routed_dp_rank": 1});
    assert_eq!(
        s.post("/v1/completions", &[("X-Data-Parallel-Rank", "3")], completion.clone())
            .await
            .1,
        Some(3)
    );
    let (status, _, body) = s
        .post("/v1/completions", &[("X-Data-Parallel-Rank", "two")], completion)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["error"]["message"].as_str().unwrap().contains("integer"));
    for rank in [4, -1] {
        let (status, _, body) = s.post("/generate", &[], gen(json!({"routed_dp_rank": rank}))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["message"], format!("DP rank {rank} is not active."));
    }
}

async fn futures_collect(s: &Server, bodies: impl Iterator<Item = Value>) -> Vec<Option<u64>> {
    let mut out = Vec::new();
    for b in bodies {
        out.push(s.post("/generate", &[], b).await.1);
    }
    out
}

#[tokio::test]
async fn a_prompt_of_the_context_length_or_more_is_refused_as_sglang_refuses_it() {
    let s = start(EngineConfig {
        context_length: 100,
        ..config(2, "zero", 1.0)
    })
    .await;
    let ids = |n: u32| json!({"input_ids": (0..n).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 1}});
    assert_eq!(s.post("/generate", &[], ids(99)).await.0, StatusCode::OK);
    let (status, _, body) = s.post("/generate", &[], ids(100)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body["error"]["message"],
        "The input (100 tokens) is longer than the model's context length (100 tokens)."
    );
    // A chat, counted in the tokens of its rendering.
    let chat = json!({"messages": [{"role": "user", "content": "word ".repeat(200)}], "max_tokens": 1});
    assert_eq!(
        s.post("/v1/chat/completions", &[], chat).await.0,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn vllm_mode_reads_only_the_header() {
    let s = start(EngineConfig {
        api: Api::Vllm,
        ..config(4, "zero", 1.0)
    })
    .await;
    let body = json!({"prompt": "hi", "max_tokens": 1, "routed_dp_rank": 3});
    assert_eq!(
        s.post("/v1/completions", &[("X-data-parallel-rank", "2")], body.clone())
            .await
            .1,
        Some(2)
    );
    // The body field is not vLLM's; an unparsable header is ignored; out of range is an error.
    assert_eq!(s.post("/v1/completions", &[], body.clone()).await.1, Some(0));
    assert_eq!(
        s.post("/v1/completions", &[("X-data-parallel-rank", "x")], body.clone())
            .await
            .1,
        Some(1)
    );
    assert_eq!(
        s.post("/v1/completions", &[("X-data-parallel-rank", "9")], body)
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn streaming_and_whole_responses_carry_the_same_tokens() {
    let s = start(config(1, "zero", 1.0)).await;
    for path in ["/v1/chat/completions", "/v1/completions", "/generate"] {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}], "prompt": "x", "text": "x",
                              "max_tokens": 6, "sampling_params": {"max_new_tokens": 6}, "stream_options": {"include_usage": true}});
        if path != "/v1/chat/completions" {
            body.as_object_mut().unwrap().remove("messages");
        }
        let (_, _, whole) = s.post(path, &[], body.clone()).await;
        body["stream"] = json!(true);
        let (_, events) = s.stream(path, body).await;
        let (whole_text, streamed) = match path {
            "/v1/chat/completions" => (
                whole["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
                events
                    .iter()
                    .filter_map(|e| e["choices"].get(0)?["delta"]["content"].as_str())
                    .collect::<String>(),
            ),
            "/v1/completions" => (
                whole["choices"][0]["text"].as_str().unwrap().to_string(),
                events
                    .iter()
                    .filter_map(|e| e["choices"].get(0)?["text"].as_str())
                    .collect::<String>(),
            ),
            _ => (
                whole["text"].as_str().unwrap().to_string(),
                events.last().unwrap()["text"].as_str().unwrap().to_string(),
            ),
        };
        assert_eq!(whole_text.split_whitespace().count(), 6, "{path}");
        assert_eq!(streamed, whole_text, "{path}");
        if path != "/generate" {
            let usage = &events.last().unwrap()["usage"];
            assert_eq!(
                (usage["completion_tokens"].as_u64(), usage["prompt_tokens"].as_u64()),
                (
                    whole["usage"]["completion_tokens"].as_u64(),
                    whole["usage"]["prompt_tokens"].as_u64()
                ),
                "{path}"
            );
        }
    }
}

#[tokio::test]
async fn responses_stream_typed_events_that_agree_with_the_whole_response() {
    let s = start(config(1, "zero", 1.0)).await;
    let body = json!({"model": "m", "instructions": "Be terse.", "input": "hi", "max_output_tokens": 5});
    let (status, _, whole) = s.post("/v1/responses", &[], body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_eq!(
        (whole["object"].as_str(), whole["status"].as_str()),
        (Some("response"), Some("incomplete"))
    );
    let text = whole["output"][0]["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text.split_whitespace().count(), 5);
    assert_eq!(whole["usage"]["output_tokens"], 5);
    assert!(whole["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        whole["usage"]["input_tokens_details"]["cached_tokens"].as_u64(),
        Some(0)
    );

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let mut resp = s.send("/v1/responses", &[], &streamed).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let raw = resp.body_mut().collect().await.unwrap().to_bytes();
    let raw = std::str::from_utf8(&raw).unwrap();
    let events: Vec<(&str, Value)> = raw
        .split_terminator("\n\n")
        .map(|event| {
            let (kind, data) = event.split_once('\n').unwrap();
            let kind = kind.strip_prefix("event: ").unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], kind);
            (kind, data)
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(kinds.iter().filter(|k| **k == "response.output_text.delta").count(), 5);
    assert_eq!(kinds.last(), Some(&"response.incomplete"));
    let sequence: Vec<u64> = events
        .iter()
        .map(|(_, e)| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
    let deltas: String = events.iter().filter_map(|(_, e)| e.get("delta")?.as_str()).collect();
    assert_eq!(deltas, text, "greedy: the same answer");
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"].as_str(), Some(text.as_str()));
    assert_eq!(last["usage"]["input_tokens"], whole["usage"]["input_tokens"]);
    assert!(
        last["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0,
        "the second time, cached"
    );
}

#[tokio::test]
async fn a_stored_response_is_continued_and_read() {
    let s = start(config(1, "zero", 1.0)).await;
    let first = json!({"model": "m", "instructions": "Be terse.", "input": "hi", "max_output_tokens": 3});
    let (status, _, made) = s.post("/v1/responses", &[], first).await;
    assert_eq!(status, StatusCode::OK, "{made}");
    let id = made["id"].as_str().unwrap().to_string();
    // The next turn's prompt extends the stored one: all of it but the new input is cached.
    let next = json!({"model": "m", "input": "and then?", "previous_response_id": id, "max_output_tokens": 3});
    let (status, _, continued) = s.post("/v1/responses", &[], next).await;
    assert_eq!(status, StatusCode::OK, "{continued}");
    let (input, cached) = (
        continued["usage"]["input_tokens"].as_u64().unwrap(),
        continued["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    );
    assert!(
        input > made["usage"]["input_tokens"].as_u64().unwrap() && cached > 0,
        "{continued}"
    );
    let got = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!(got["id"], json!(id));
    let unknown = json!({"model": "m", "input": "x", "previous_response_id": "resp_nope"});
    let (status, _, refused) = s.post("/v1/responses", &[], unknown).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{refused}");
    let not_kept = json!({"model": "m", "input": "x", "store": false, "max_output_tokens": 1});
    let (_, _, made) = s.post("/v1/responses", &[], not_kept).await;
    let gone = s.get(&format!("/v1/responses/{}", made["id"].as_str().unwrap())).await;
    assert_eq!(gone["error"]["code"], 404, "store: false keeps nothing: {gone}");
}

#[tokio::test]
async fn get_load_reflects_running_requests_and_disconnects_abort() {
    // Slow decode: 1,000 tokens at 50 ms each keep the request running while we look.
    let mut cfg = config(2, "zero", 1.0);
    cfg.cost.tpot_s = 0.05;
    let s = start(cfg).await;
    let body = json!({"text": "long answer please", "sampling_params": {"max_new_tokens": 1000}, "stream": true, "routed_dp_rank": 1});
    let mut resp = s.send("/generate", &[], &body).await;
    let _first = resp.body_mut().frame().await.unwrap().unwrap();
    let load = s.get("/get_load").await;
    assert_eq!(
        (load[1]["num_reqs"].as_u64(), load[0]["num_reqs"].as_u64()),
        (Some(1), Some(0)),
        "{load}"
    );
    assert_eq!(s.get("/get_server_info").await["aborted_requests"], 0);
    drop(resp);
    let mut aborted = 0;
    for _ in 0..100 {
        aborted = s.get("/get_server_info").await["aborted_requests"].as_u64().unwrap();
        if aborted == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(aborted, 1);
    assert_eq!(s.get("/get_load").await[1]["num_reqs"], 0);
    assert_eq!(s.engine.completed(), 0);
}

#[tokio::test]
async fn faults_are_injected() {
    let faults = Faults {
        error_rate: 1.0,
        ..Faults::default()
    };
    let s = start(EngineConfig {
        faults,
        ..config(1, "zero", 1.0)
    })
    .await;
    assert_eq!(
        s.post("/generate", &[], json!({"text": "x"})).await.0,
        StatusCode::INTERNAL_SERVER_ERROR
    );

    let faults = Faults {
        drop_after_tokens: Some(3),
        dead_ranks: vec![1],
        unhealthy: true,
        ..Faults::default()
    };
    let s = start(EngineConfig {
        faults,
        ..config(2, "zero", 1.0)
    })
    .await;
    let resp = s
        .client
        .get(format!("http://{}/health", s.addr).parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        s.post("/generate", &[], json!({"text": "x", "routed_dp_rank": 1}))
            .await
            .0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Round robin skips the dead rank.
    assert_eq!(s.post("/generate", &[], json!({"text": "x"})).await.1, Some(0));
    assert_eq!(s.post("/generate", &[], json!({"text": "x"})).await.1, Some(0));
    let resp = s
        .send(
            "/generate",
            &[],
            &json!({"text": "x", "stream": true, "sampling_params": {"max_new_tokens": 10}}),
        )
        .await;
    assert!(resp.into_body().collect().await.is_err(), "the stream breaks mid-way");
}

/// `drop_rate`: that fraction of streams break (no final event, no `[DONE]`) after a number of tokens that varies
/// from none to all of them, the same streams at the same points for the same seed; whole responses never break,
/// and a broken stream's slot is released.
#[tokio::test]
async fn a_fraction_of_streams_break_after_a_random_number_of_tokens() {
    async fn run(seed: u64) -> (Server, Vec<Option<usize>>) {
        let s = start(EngineConfig {
            faults: Faults {
                drop_rate: 0.5,
                ..Faults::default()
            },
            seed,
            ..config(2, "zero", 1.0)
        })
        .await;
        let mut outcomes = Vec::new();
        for i in 0..60 {
            let body = json!({"text": format!("p{i}"), "stream": true, "sampling_params": {"max_new_tokens": 8}});
            let mut resp = s.send("/generate", &[], &body).await;
            assert_eq!(resp.status(), StatusCode::OK);
            let mut text = String::new();
            let broken = loop {
                match resp.body_mut().frame().await {
                    None => break false,
                    Some(Err(_)) => break true,
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            text.push_str(std::str::from_utf8(&data).unwrap());
                        }
                    }
                }
            };
            let events = text.matches("data: ").count();
            if broken {
                assert!(!text.contains("[DONE]"), "{text}");
                assert!(events <= 8, "{text}");
                outcomes.push(Some(events));
            } else {
                assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
                outcomes.push(None);
            }
        }
        (s, outcomes)
    }
    let (s, outcomes) = run(7).await;
    let broken: Vec<usize> = outcomes.iter().flatten().copied().collect();
    assert!((15..=45).contains(&broken.len()), "{outcomes:?}");
    let mut points = broken.clone();
    points.sort_unstable();
    points.dedup();
    assert_eq!(
        points,
        (0..=8).collect::<Vec<_>>(),
        "streams break after none to all of the tokens: {outcomes:?}"
    );
    assert_eq!(run(7).await.1, outcomes, "the same seed breaks the same streams");
    assert_ne!(run(8).await.1, outcomes, "another seed breaks others");

    for i in 0..20 {
        let (status, _, body) = s
            .post(
                "/generate",
                &[],
                json!({"text": format!("w{i}"), "sampling_params": {"max_new_tokens": 8}}),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "whole responses never break: {body}");
    }
    let load = s.get("/get_load").await;
    assert!(load.as_array().unwrap().iter().all(|r| r["num_reqs"] == 0), "{load}");
    assert_eq!(s.get("/get_server_info").await["aborted_requests"], broken.len());
}
