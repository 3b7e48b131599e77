//! Anthropic's Messages API through `dprouter serve`, end to end on loopback: mock engines in SGLang's shape (the
//! rank in `routed_dp_rank`) serving `/v1/messages` as SGLang does, and engines scripted to record what reaches
//! them. An agent's turns (a shared system prompt and tools, scripted `tool_use` / `tool_result` turns) go to the
//! rank that holds their prefix; the engine's usage (`input_tokens` uncached, `cache_read_input_tokens`) reaches
//! the metrics as prompt and cached tokens; the gateway's own errors on these routes are in Anthropic's shape,
//! and nothing reaches an engine for them; `count_tokens` is counted by an engine and teaches no policy.
#![allow(clippy::unwrap_used)]

mod common;

use common::scripted::{header_names, Act, Scripted};
use common::{client, get, in_flight, post, token_counters, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// A request's headers.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// An agent's request: its program's system prompt and tools, then its own conversation so far.
fn turn(session: usize, turns: usize, stream: bool) -> Value {
    let system = format!(
        "You are agent program 7. {}",
        "Follow the repository's conventions. ".repeat(40)
    );
    let mut messages = vec![
        json!({"role": "user", "content": [{"type": "text", "text": format!("task {session}: fix the failing test in module {session}")}]}),
    ];
    for t in 1..turns {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": format!("Reading file {t}.")},
            {"type": "tool_use", "id": format!("toolu_{session}_{t}"), "name": "read_file", "input": {"path": format!("src/m{session}/f{t}.rs")}},
        ]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{session}_{t}"), "content": format!("fn f{t}() {{ /* {} */ }}", "body ".repeat(30))},
        ]}));
    }
    json!({
        "model": "m", "max_tokens": 4, "stream": stream,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "read_file", "description": "Reads a file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "messages": messages,
    })
}

/// The usage of a Messages answer, whole or streamed (the `message_delta` event's).
fn usage(text: &str, stream: bool) -> Value {
    if !stream {
        return serde_json::from_str::<Value>(text).unwrap()["usage"].clone();
    }
    let delta = text
        .split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str::<Value>(data).unwrap())
        .find(|event| event["type"] == "message_delta")
        .unwrap_or_else(|| panic!("no message_delta in {text}"));
    delta["usage"].clone()
}

/// Four agents, four turns each, alternately streamed: each later turn lands on its agent's rank and reads its
/// prefix from the cache there; what the engine reports (Anthropic's usage) is what the gateway counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_turns_go_to_the_rank_holding_their_prefix() {
    let engine = Proc::engine(&["--dp-size", "4"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "cache_aware"]);
    let c = client();
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut ranks = vec![Vec::new(); 4];
    for turns in 1..=4 {
        for (session, ranks) in ranks.iter_mut().enumerate() {
            let stream = (session + turns) % 2 == 0;
            let id = format!("session-{session}");
            let headers = [
                ("x-claude-code-session-id", id.as_str()),
                ("anthropic-version", "2023-06-01"),
            ];
            let reply = post(
                &c,
                &format!("{}/v1/messages", gw.url),
                &headers,
                &turn(session, turns, stream),
            )
            .await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
            let rank = reply.headers["x-dp-rank"].to_str().unwrap().to_string();
            let usage = usage(&reply.text, stream);
            let read = usage["cache_read_input_tokens"].as_u64().unwrap();
            let input = usage["input_tokens"].as_u64().unwrap();
            prompt += input + read + usage["cache_creation_input_tokens"].as_u64().unwrap_or(0);
            cached += read;
            if turns > 1 {
                assert_eq!(
                    Some(&rank),
                    ranks.first(),
                    "session {session} turn {turns} left its rank: {ranks:?}"
                );
                assert!(read > input, "session {session} turn {turns}: {usage}");
            }
            if stream {
                assert!(reply.text.starts_with("event: message_start\ndata: "), "{}", reply.text);
                assert!(reply.text.contains("event: content_block_delta"), "{}", reply.text);
            } else {
                let body: Value = serde_json::from_str(&reply.text).unwrap();
                assert_eq!(body["type"], "message", "{body}");
            }
            ranks.push(rank);
        }
    }
    assert_eq!(
        token_counters(&c, &gw.url).await,
        (prompt, cached),
        "the gateway counts what the engine reported"
    );
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

/// A request that forces a tool gets the mock's `tool_use` answer, streamed as `input_json_delta` pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_tool_call_comes_back_as_tool_use() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &[]);
    let c = client();
    let mut body = turn(0, 2, false);
    body["tool_choice"] = json!({"type": "any"});
    let reply = post(&c, &format!("{}/v1/messages", gw.url), &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let answer: Value = serde_json::from_str(&reply.text).unwrap();
    assert_eq!(answer["stop_reason"], "tool_use", "{answer}");
    assert_eq!(answer["content"][0]["type"], "tool_use", "{answer}");
    assert_eq!(answer["content"][0]["name"], "read_file", "{answer}");
    body["stream"] = json!(true);
    let reply = post(&c, &format!("{}/v1/messages", gw.url), &[], &body).await;
    let json: String = reply
        .text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|e| e["delta"]["type"] == "input_json_delta")
        .map(|e| e["delta"]["partial_json"].as_str().unwrap().to_string())
        .collect();
    let input: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert!(input["text"].is_string(), "{input}");
}

/// The gateway's own errors on the Messages routes are Anthropic's (`{"type": "error", "error": {"type",
/// "message"}}`), with the right status, and none of those requests reaches an engine; keys are read from
/// `x-api-key` as from `Authorization: Bearer`, and never reach the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_errors_on_the_messages_routes_are_anthropics() {
    let engine = Scripted::start(Act::Json(
        r#"{"type": "message", "content": [], "usage": {"input_tokens": 3}}"#,
    ))
    .await;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let config = dir.join("anthropic-clients.toml");
    // `printf %s key-alice | sha256sum`.
    let alice = "87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef";
    std::fs::write(
        &config,
        format!("[[clients]]\nname = \"alice\"\nkey_sha256 = \"{alice}\"\n"),
    )
    .unwrap();
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine.url,
        "--backend",
        "openai",
        "--config",
        config.to_str().unwrap(),
    ]);
    let c = client();
    let url = format!("{}/v1/messages", gw.url);
    let good = turn(0, 1, false);
    let cases: [(Headers, Value, u16, &str); 5] = [
        (&[], good.clone(), 401, "authentication_error"),
        (
            &[("x-api-key", "sk-mallory")],
            good.clone(),
            401,
            "authentication_error",
        ),
        (
            &[("x-api-key", "key-alice")],
            json!({"model": "m", "messages": "not a list"}),
            400,
            "invalid_request_error",
        ),
        (
            &[("x-api-key", "key-alice")],
            json!({"model": "m", "system": "no messages"}),
            400,
            "invalid_request_error",
        ),
        (
            &[("x-api-key", "key-alice")],
            json!([1, 2]),
            400,
            "invalid_request_error",
        ),
    ];
    for (headers, body, status, kind) in cases {
        let reply = post(&c, &url, headers, &body).await;
        assert_eq!(reply.status.as_u16(), status, "{headers:?} {body}: {}", reply.text);
        assert_eq!(reply.json["type"], "error", "{}", reply.text);
        assert_eq!(reply.json["error"]["type"], kind, "{}", reply.text);
        assert!(reply.json["error"]["message"].is_string(), "{}", reply.text);
        assert!(reply.json["request_id"].is_string(), "{}", reply.text);
    }
    assert!(
        engine.posts().is_empty(),
        "refused requests reached the engine: {:?}",
        engine.posts()
    );
    // The same gateway's other routes keep OpenAI's shape.
    let chat = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[],
        &json!({"messages": []}),
    )
    .await;
    assert_eq!(chat.json["error"]["type"], "authentication_error", "{}", chat.text);
    assert_eq!(chat.json["error"]["code"], 401, "{}", chat.text);
    // A good key in `x-api-key`: through, the key itself nowhere in what the engine got.
    let headers = [
        ("x-api-key", "key-alice"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "tools-2024"),
    ];
    let reply = post(&c, &url, &headers, &good).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let posts = engine.posts();
    assert_eq!(posts.len(), 1, "{posts:?}");
    let (head, _) = &posts[0];
    assert!(head.starts_with("post /v1/messages "), "{head}");
    let names = header_names(head);
    assert!(
        !names.contains(&"x-api-key".to_string()) && !head.contains("key-alice"),
        "{head}"
    );
    for name in ["anthropic-version", "anthropic-beta"] {
        assert!(names.contains(&name.to_string()), "{name} reaches the engine: {head}");
    }
}

/// An unknown model is Anthropic's `not_found_error` (404) where the workers' models are known; the engine's own
/// error answer (here a prompt over its context length) passes as the engine wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_and_the_engines_own_errors() {
    let small = Proc::engine(&["--dp-size", "1", "--model", "small", "--context-length", "64"]);
    let large = Proc::engine(&["--dp-size", "1", "--model", "large"]);
    let gw = Proc::gateway(&[&small, &large], &[]);
    let c = client();
    let url = format!("{}/v1/messages", gw.url);
    let mut body = turn(0, 1, false);
    body["model"] = json!("medium");
    let reply = post(&c, &url, &[], &body).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{}", reply.text);
    assert_eq!(reply.json["error"]["type"], "not_found_error", "{}", reply.text);
    body["model"] = json!("small");
    let reply = post(&c, &url, &[], &body).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
    assert_eq!(reply.json["type"], "error", "{}", reply.text);
    assert!(
        reply.json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context length"),
        "the engine's own message: {}",
        reply.text
    );
    assert!(
        reply.json.get("request_id").is_none(),
        "not the gateway's error: {}",
        reply.text
    );
}

/// `count_tokens` is counted by an engine serving the model (as many tokens as the Messages request's prompt) and
/// makes no routing decision: nothing for a policy to learn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_is_counted_by_an_engine_and_teaches_no_policy() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &[]);
    let c = client();
    let decisions = || async {
        let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
        workers["decisions"].clone()
    };
    let before = decisions().await;
    let reply = post(
        &c,
        &format!("{}/v1/messages/count_tokens", gw.url),
        &[],
        &turn(1, 3, false),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let counted = reply.json["input_tokens"].as_u64().unwrap();
    assert!(counted > 100, "{}", reply.text);
    assert_eq!(decisions().await, before, "count_tokens made no routing decision");
    // The same request sent for real reports the same prompt.
    let reply = post(&c, &format!("{}/v1/messages", gw.url), &[], &turn(1, 3, false)).await;
    let usage = &reply.json["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(prompt, counted, "{}", reply.text);
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("dprouter_requests_total") && l.contains("/v1/messages/count_tokens")),
        "count_tokens is counted apart by its route"
    );
}

/// Claude Code's session header keeps an agent's turn on the endpoint of its last one even when its prompt alone
/// would move it: here the turn starts with another client's long document, which that client sent to the other
/// rank. Without the header the same turn goes where the document is cached; with it, home (`GET /workers` counts
/// the session there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claude_code_session_stays_home_when_its_prompt_alone_would_move_it() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "cache_aware"]);
    let c = client();
    let url = format!("{}/v1/messages", gw.url);
    let session = [("x-claude-code-session-id", "9f1c-agent")];
    let message =
        |text: String| json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]});
    let first = post(&c, &url, &session, &message("Start the task.".into())).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    let home = first.headers["x-dp-rank"].to_str().unwrap().to_string();
    let other = if home == "0" { "1" } else { "0" };
    let document = "The design document of the module, section by section. ".repeat(200);
    let pinned = post(&c, &url, &[("x-data-parallel-rank", other)], &message(document.clone())).await;
    assert_eq!(pinned.headers["x-dp-rank"].to_str().unwrap(), other, "{}", pinned.text);
    let turn = message(format!("{document} Now summarize it."));
    let by_prompt = post(&c, &url, &[], &turn).await;
    assert_eq!(
        by_prompt.headers["x-dp-rank"].to_str().unwrap(),
        other,
        "the prompt alone goes to its cache"
    );
    let kept = post(&c, &url, &session, &turn).await;
    assert_eq!(
        kept.headers["x-dp-rank"].to_str().unwrap(),
        home,
        "the session stays home"
    );
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    let sessions: Vec<u64> = workers["workers"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sessions"].as_u64().unwrap())
        .collect();
    let home: usize = home.parse().unwrap();
    assert_eq!(sessions[home], 1, "{workers}");
    assert_eq!(workers["decisions"]["session"], 1, "{workers}");
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    let series = format!("dprouter_endpoint_sessions{{endpoint=\"w0r{home}\"}} 1");
    assert!(metrics.lines().any(|l| l == series), "{series} in {metrics}");
}
