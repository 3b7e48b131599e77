//! End-to-end: the engine's usage report reaches the gateway's metrics (and the policy, through the request's
//! ticket) as soon as the gateway has read it, in each engine's format, even when the client hangs up at `[DONE]`.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{client, eventually, Proc};
use http_body_util::BodyExt;
use hyper::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An OpenAI-compatible engine scripted at the TCP level: every chat request gets a stream whose last event
/// carries `last` (a llama.cpp `timings` member or an OpenAI `usage` one), then `[DONE]`, and then the body stays
/// open (the end of the chunked body never comes), so only a gateway that records the report as soon as it reads
/// it can record it.
async fn engine(last: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve_one(socket, last));
        }
    });
    url
}

async fn serve_one(mut socket: TcpStream, last: &'static str) {
    let Some((head, length)) = common::read_head(&mut socket).await else {
        return;
    };
    if head.starts_with("get /health") {
        let _ = socket.write_all(common::json_answer("{}").as_bytes()).await;
        return;
    }
    let mut body = vec![0u8; length];
    if socket.read_exact(&mut body).await.is_err() {
        return;
    }
    let events = [
        r#"data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#.to_string(),
        r#"data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}"#.to_string(),
        format!(r#"data: {{"choices":[{{"index":0,"delta":{{}},"finish_reason":"stop"}}],{last}}}"#),
        "data: [DONE]".to_string(),
    ];
    let mut out =
        String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
    for event in events {
        let event = format!("{event}\n\n");
        out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
    }
    let _ = socket.write_all(out.as_bytes()).await;
    // No terminating chunk: the body stays open until the gateway lets go of it.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), socket.read_to_end(&mut rest)).await;
}

/// Streams `n` chats, each read up to `[DONE]` and then dropped (as the OpenAI SDK does); returns the gateway's
/// prompt and cached token counters afterwards.
async fn chats_closed_at_done(last: &'static str, n: u64) -> (u64, u64) {
    let engine = engine(last).await;
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine,
        "--backend",
        "openai",
    ]);
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": true});
    for _ in 0..n {
        let response = common::send(&c, &url, &[], body.to_string()).await;
        assert_eq!(response.status(), StatusCode::OK);
        let mut response = response.into_body();
        let mut text = String::new();
        while !text.contains("[DONE]") {
            let frame = tokio::time::timeout(Duration::from_secs(5), response.frame())
                .await
                .expect("the stream reached [DONE]")
                .unwrap()
                .unwrap();
            text.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap_or_default()));
        }
        drop(response);
    }
    // Every in-flight count comes back: the ticket ended with the client's hang-up.
    assert!(
        eventually(Duration::from_secs(5), || async {
            common::in_flight(&c, &gw.url).await == 0
        })
        .await
    );
    common::token_counters(&c, &gw.url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_cpp_timings_count_when_the_client_hangs_up_at_done() {
    // llama.cpp: `prompt_n` tokens evaluated, `cache_n` reused; no `usage` without `include_usage`.
    let (prompt, cached) = chats_closed_at_done(r#""timings":{"cache_n":30,"prompt_n":12,"predicted_n":1}"#, 8).await;
    assert_eq!((prompt, cached), (8 * 42, 8 * 30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_usage_counts_when_the_client_hangs_up_at_done() {
    let usage = r#""usage":{"prompt_tokens":50,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":48}}"#;
    let (prompt, cached) = chats_closed_at_done(usage, 8).await;
    assert_eq!((prompt, cached), (8 * 50, 8 * 48));
}

/// OpenAI Responses: the report is `usage.input_tokens` with `input_tokens_details`, and in a stream it sits
/// inside the `response` of the last event (after the whole output); the gateway counts it either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_usage_counts_whole_and_streamed() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let gw = Proc::gateway(&[&engine], &["--policy", "prefix_match"]);
    let c = client();
    let url = format!("{}/v1/responses", gw.url);
    let body =
        json!({"model": "m", "instructions": "Answer briefly. ".repeat(50), "input": "hi", "max_output_tokens": 3});
    let whole = common::post(&c, &url, &[], &body).await;
    assert_eq!(whole.status, StatusCode::OK, "{}", whole.text);
    let mut expected = (
        whole.json["usage"]["input_tokens"].as_u64().unwrap(),
        whole.json["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    );
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let stream = common::post(&c, &url, &[], &streamed).await;
    assert_eq!(stream.status, StatusCode::OK, "{}", stream.text);
    let last = stream.text.trim_end().rsplit("data: ").next().unwrap();
    let last: serde_json::Value = serde_json::from_str(last).unwrap();
    let usage = &last["response"]["usage"];
    expected.0 += usage["input_tokens"].as_u64().unwrap();
    expected.1 += usage["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(expected.1 > 0, "the second request hit the cache: {usage}");
    assert_eq!(common::token_counters(&c, &gw.url).await, expected);
}
