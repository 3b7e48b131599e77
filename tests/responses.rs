//! End-to-end: OpenAI Responses conversations through the gateway, in front of two mock engines that store their
//! responses. A turn that continues a stored response (`previous_response_id`) goes to the endpoint that made it,
//! whatever the policy, and the stored response can be read and deleted through the gateway.
#![allow(clippy::unwrap_used)]

mod common;

use common::scripted::{Act, Scripted};
use common::{client, get, post, read, Proc};
use http_body_util::Full;
use hyper::{Request, StatusCode};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_with_the_endpoint_that_stored_it() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "2"]);
    // round_robin sends consecutive requests to different endpoints: only the gateway's memory keeps a
    // conversation on its endpoint (anywhere else, the engine does not know the previous response: a 404).
    let gw = Proc::gateway(&[&a, &b], &["--policy", "round_robin"]);
    let c = client();
    let url = format!("{}/v1/responses", gw.url);
    for conversation in 0..3 {
        let mut previous: Option<String> = None;
        let mut home = None;
        for turn in 0..6 {
            let mut body = json!({"model": "m", "input": format!("turn {turn}"), "max_output_tokens": 2,
                                  "instructions": format!("conversation {conversation}")});
            if let Some(id) = &previous {
                body["previous_response_id"] = json!(id);
            }
            // Half the turns streamed: the id then comes in the first event.
            let streamed = turn % 2 == 1;
            if streamed {
                body["stream"] = json!(true);
            }
            let reply = post(&c, &url, &[], &body).await;
            assert_eq!(
                reply.status,
                StatusCode::OK,
                "conversation {conversation} turn {turn}: {}",
                reply.text
            );
            let response = if streamed {
                let last = reply.text.trim_end().rsplit("data: ").next().unwrap();
                serde_json::from_str::<serde_json::Value>(last).unwrap()["response"].clone()
            } else {
                reply.json.clone()
            };
            let endpoint = reply.endpoint.clone().unwrap();
            assert_eq!(
                *home.get_or_insert(endpoint.clone()),
                endpoint,
                "conversation {conversation} turn {turn}"
            );
            if turn > 0 {
                let cached = response["usage"]["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                assert!(cached > 0, "the conversation's cache is on its endpoint: {response}");
            }
            previous = Some(response["id"].as_str().unwrap().to_string());
        }
        // The last response is read and deleted at its worker, through the gateway.
        let id = previous.unwrap();
        let stored = get(&c, &format!("{url}/{id}")).await;
        assert_eq!(
            (stored.status, stored.json["id"].as_str()),
            (StatusCode::OK, Some(id.as_str()))
        );
        let delete = Request::delete(format!("{url}/{id}")).body(Full::default()).unwrap();
        let deleted = read(c.request(delete).await.unwrap()).await;
        assert_eq!(deleted.json["deleted"], json!(true), "{}", deleted.text);
        assert_eq!(get(&c, &format!("{url}/{id}")).await.status, StatusCode::NOT_FOUND);
    }
    let unknown = get(&c, &format!("{url}/resp_unknown")).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert!(
        unknown.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("resp_unknown"),
        "{}",
        unknown.text
    );
}

/// With keyed clients, a stored response is its client's: another client gets the 404 of an unknown id for it, to
/// read, delete or continue it, and its request never reaches an engine; its own client reads and continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_clients_responses_are_its_own() {
    // `printf %s key-alice | sha256sum`, and bob's.
    const ALICE: &str = "87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef";
    const BOB: &str = "f031fc74d10cf0c1284dc15f679c18b1e8e05f9d1966adefba6c6463cdcef658";
    let engine = Proc::engine(&["--dp-size", "2"]);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("responses");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("keyed.toml");
    std::fs::write(
        &config,
        format!(
            "[[clients]]\nname = \"alice\"\nkey_sha256 = \"{ALICE}\"\n\n[[clients]]\nname = \"bob\"\nkey_sha256 = \"{BOB}\"\n"
        ),
    )
    .unwrap();
    let gw = Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let c = client();
    let url = format!("{}/v1/responses", gw.url);
    let (alice, bob) = (
        [("authorization", "Bearer key-alice")],
        [("authorization", "Bearer key-bob")],
    );
    let body = json!({"model": "m", "input": "hello", "max_output_tokens": 2});
    let made = post(&c, &url, &alice, &body).await;
    assert_eq!(made.status, StatusCode::OK, "{}", made.text);
    let id = made.json["id"].as_str().unwrap().to_string();
    let served = || async {
        let info = get(&c, &format!("{}/get_server_info", engine.url)).await;
        info.json["completed_requests"].as_u64().unwrap()
    };
    let before = served().await;
    // Bob: unknown, to read, to delete and to continue.
    let stored = format!("{url}/{id}");
    for method in [hyper::Method::GET, hyper::Method::DELETE] {
        let reply = common::call(&c, method.clone(), &stored, &bob, None).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{method} {}", reply.text);
        assert_eq!(reply.json["error"]["type"], "not_found_error", "{}", reply.text);
    }
    let continued = json!({"model": "m", "input": "more", "max_output_tokens": 2, "previous_response_id": id});
    let reply = post(&c, &url, &bob, &continued).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text);
    assert!(
        reply.json["error"]["message"].as_str().unwrap().contains(&id),
        "{}",
        reply.text
    );
    assert_eq!(served().await, before, "bob's requests reached no engine");
    // Alice: hers, to read and to continue.
    let read_back = common::call(&c, hyper::Method::GET, &stored, &alice, None).await;
    assert_eq!(read_back.status, StatusCode::OK, "{}", read_back.text);
    let reply = post(&c, &url, &alice, &continued).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
}

/// A Responses stream opens with events the engine sends before it has computed anything (`response.created`,
/// `response.in_progress`: vLLM and SGLang send them at once): its first token, for the TTFT and for the
/// endpoint's prefill sample, is its first delta, not its first byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_streams_first_token_is_its_first_delta() {
    const EVENTS: &[(u64, &str)] = &[
        (0, "event: response.created\ndata: {\"type\": \"response.created\", \"response\": {\"id\": \"resp_1\"}}\n\n"),
        (0, "event: response.in_progress\ndata: {\"type\": \"response.in_progress\"}\n\n"),
        (600, "event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\", \"delta\": \"a\"}\n\n"),
        (0, "event: response.completed\ndata: {\"type\": \"response.completed\", \"response\": {\"usage\": {\"input_tokens\": 3, \"output_tokens\": 1, \"input_tokens_details\": {\"cached_tokens\": 0}}}}\n\n"),
    ];
    let engine = Scripted::start(Act::Events(EVENTS)).await;
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine.url,
        "--backend",
        "vllm",
    ]);
    let c = client();
    let body = json!({"model": "m", "input": "hi", "stream": true});
    let reply = post(&c, &format!("{}/v1/responses", gw.url), &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert!(reply.text.contains("response.completed"), "{}", reply.text);
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    let ttft = common::metric_sum(&metrics, "dprouter_ttft_seconds_sum");
    assert!(
        ttft >= 0.6,
        "TTFT {ttft} s: the first byte taken for the first token: {metrics}"
    );
}
