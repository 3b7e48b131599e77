//! The client's trace context reaches the engine through `serve`: `traceparent`, `tracestate` and `baggage`
//! unchanged, a malformed `traceparent` (and its `tracestate`) not at all. The engine here answers every request
//! with the headers it got.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use dprouter_gateway::upstream::{Chunks, Upstream};
use dprouter_gateway::{AppState, Backend, GatewayConfig, WorkerConfig};
use serde_json::{json, Map, Value};

/// An OpenAI-style server that answers any request with the headers it got (`/health` too).
async fn echo_engine() -> String {
    let echo = |headers: HeaderMap| async move {
        let got: Map<String, Value> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v.to_str().unwrap_or("?"))))
            .collect();
        axum::Json(json!({"headers": got}))
    };
    let app = axum::Router::new().fallback(echo);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

async fn gateway(engine: &str) -> String {
    let mut config = GatewayConfig::default();
    config.workers.push(WorkerConfig {
        url: engine.to_string(),
        backend: Backend::Openai,
        ..Default::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    config.listen = listener.local_addr().unwrap();
    let state = AppState::new(config.clone()).await.unwrap();
    tokio::spawn(dprouter_gateway::serve(listener, state, std::future::pending()));
    format!("http://{}", config.listen)
}

/// What the engine got for a chat sent with `headers`.
async fn engine_saw(gateway: &str, headers: &[(&str, &str)]) -> Value {
    let tls = dprouter_gateway::upstream::client_config(None, "ca").unwrap();
    let client = Upstream::new(Duration::from_secs(2), Duration::from_secs(5), tls);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut request =
        hyper::Request::post(format!("{gateway}/v1/chat/completions")).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Chunks::new([Bytes::from(body)])).unwrap();
    let (status, _, answer) = client
        .exchange(request, Duration::from_secs(10), 1 << 20)
        .await
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    serde_json::from_slice::<Value>(&answer).unwrap()["headers"].clone()
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn the_clients_trace_context_reaches_the_engine_and_a_malformed_one_does_not() {
    let gateway = gateway(&echo_engine().await).await;
    let seen = engine_saw(
        &gateway,
        &[
            ("traceparent", PARENT),
            ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
            ("baggage", "userId=alice,serverNode=DF%2028"),
        ],
    )
    .await;
    assert_eq!(seen["traceparent"], PARENT, "{seen}");
    assert_eq!(seen["tracestate"], "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE");
    assert_eq!(seen["baggage"], "userId=alice,serverNode=DF%2028");

    let seen = engine_saw(
        &gateway,
        &[
            ("traceparent", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"),
            ("tracestate", "rojo=00f067aa0ba902b7"),
            ("baggage", "k=v"),
        ],
    )
    .await;
    assert!(
        seen.get("traceparent").is_none(),
        "a malformed traceparent went on: {seen}"
    );
    assert!(
        seen.get("tracestate").is_none(),
        "a tracestate without its parent went on: {seen}"
    );
    assert_eq!(seen["baggage"], "k=v");

    let seen = engine_saw(&gateway, &[]).await;
    for name in ["traceparent", "tracestate", "baggage"] {
        assert!(seen.get(name).is_none(), "{name} out of nowhere: {seen}");
    }
}
