//! Clients and keys end to end (`[[clients]]`, a worker's `api_key`): `dprouter serve`, and a real Envoy asking
//! `dprouter epp`, in front of mock engines that take an API key of their own (`mock-engine --api-key`, checked
//! where SGLang checks it).
#![allow(clippy::unwrap_used)]

mod common;

use common::envoy::Envoy;
use common::picker::Picker;
use common::{get, post, Proc};
use serde_json::{json, Value};

/// `printf %s key-NAME | sha256sum` for alice, bob, carol and dave.
const ALICE: &str = "87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef";
const BOB: &str = "f031fc74d10cf0c1284dc15f679c18b1e8e05f9d1966adefba6c6463cdcef658";
const CAROL: &str = "210e84269846b00ea00f3fd42c500d17c08b42ac0f6c27ebdb1fd1a07a2dfc84";
const DAVE: &str = "08dd57d55f68cc243dc9794f8600abadb91b1b7ba90bff0c0b929cde76aba896";

/// alice may use the mock's model only; bob may send one request an hour; carol may pin ranks; dave may send 100
/// prompt tokens a minute.
fn clients() -> String {
    format!(
        r#"
[[clients]]
name = "alice"
key_sha256 = "{ALICE}"
models = ["dprouter/mock"]

[[clients]]
name = "bob"
key_sha256 = "{BOB}"
requests_per_second = 0.0003

[[clients]]
name = "carol"
key_sha256 = "{CAROL}"
allow_pins = true

[[clients]]
name = "dave"
key_sha256 = "{DAVE}"
prompt_tokens_per_minute = 100
"#
    )
}

/// A config file named `name` in the tests' temporary folder: `text`; its path.
fn config_file(name: &str, text: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("clients");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// A worker of two ranks at `engine` with its own key `engine-key`.
fn keyed_worker(engine: &Proc) -> String {
    format!("[[workers]]\nurl = \"{}\"\napi_key = \"engine-key\"\n", engine.url)
}

fn chat(model: &str) -> Value {
    json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello there"}]})
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn completed(c: &common::HttpClient, engine: &Proc) -> u64 {
    let info = get(c, &format!("{}/get_server_info", engine.url)).await;
    // The engine's own key opens its server info too (SGLang's middleware guards every route but /health).
    if info.status == 401 {
        let reply = common::call(
            c,
            hyper::Method::GET,
            &format!("{}/get_server_info", engine.url),
            &[("authorization", "Bearer engine-key")],
            None,
        )
        .await;
        return reply.json["completed_requests"].as_u64().unwrap();
    }
    info.json["completed_requests"].as_u64().unwrap()
}

/// What every front door must do with keyed clients, at `base` (the gateway's or Envoy's).
async fn keyed_clients_are_checked(c: &common::HttpClient, base: &str, engine: &Proc) {
    let url = &format!("{base}/v1/chat/completions");
    // The model list too needs a key.
    let models = format!("{base}/v1/models");
    let reply = get(c, &models).await;
    assert_eq!(reply.status, 401, "{}", reply.text);
    let reply = common::call(
        c,
        hyper::Method::GET,
        &models,
        &[("authorization", "Bearer key-alice")],
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // No key, a wrong key, another scheme: 401, and nothing reaches the engine.
    for auth in [
        None,
        Some("Bearer key-mallory"),
        Some("Basic key-alice"),
        Some("Bearer engine-key"),
    ] {
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
        let reply = post(c, url, &headers, &chat("dprouter/mock")).await;
        assert_eq!(reply.status, 401, "{auth:?}: {}", reply.text);
        assert_eq!(reply.json["error"]["type"], "authentication_error", "{}", reply.text);
    }
    assert_eq!(completed(c, engine).await, 0, "a refused request reached the engine");
    // alice's key is good; the engine, which takes only its own key, got its own (not alice's).
    let alice = bearer("key-alice");
    let reply = post(c, url, &[("authorization", &alice)], &chat("dprouter/mock")).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // Her model list holds.
    let reply = post(c, url, &[("authorization", &alice)], &chat("other")).await;
    assert_eq!(reply.status, 403, "{}", reply.text);
    assert!(reply.text.contains("may not use the model"), "{}", reply.text);
    // bob's second request in an hour is over his limit; alice is not affected.
    let bob = bearer("key-bob");
    let first = post(c, url, &[("authorization", &bob)], &chat("dprouter/mock")).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let second = post(c, url, &[("authorization", &bob)], &chat("dprouter/mock")).await;
    assert_eq!(second.status, 429, "{}", second.text);
    let retry: u64 = second.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry > 60, "Retry-After {retry}");
    let reply = post(c, url, &[("authorization", &alice)], &chat("dprouter/mock")).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // A pin is bob's only if he may: rank 9 does not exist, and is ignored for him.
    let carol = bearer("key-carol");
    let pinned = post(
        c,
        url,
        &[("authorization", &carol), ("x-data-parallel-rank", "1")],
        &chat("dprouter/mock"),
    )
    .await;
    assert_eq!(pinned.status, 200, "{}", pinned.text);
    assert_eq!(pinned.endpoint.as_deref(), Some("w0r1"));
    let dave = bearer("key-dave");
    let ignored = post(
        c,
        url,
        &[("authorization", &dave), ("x-data-parallel-rank", "9")],
        &chat("dprouter/mock"),
    )
    .await;
    assert_eq!(ignored.status, 200, "{}", ignored.text);
    // dave's 100 prompt tokens a minute: a long prompt is over them.
    let long = json!({"model": "dprouter/mock", "max_tokens": 2, "prompt": (0..150).collect::<Vec<u32>>()});
    let reply = post(c, url, &[("authorization", &dave)], &long).await;
    assert_eq!(reply.status, 429, "{}", reply.text);
    assert!(reply.text.contains("prompt_tokens_per_minute"), "{}", reply.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_checks_keys_models_limits_and_pins_and_sends_the_workers_own_key() {
    let c = common::client();
    let engine = Proc::engine(&["--dp-size", "2", "--api-key", "engine-key"]);
    let config = config_file("serve.toml", &format!("{}{}", keyed_worker(&engine), clients()));
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", &config]);
    keyed_clients_are_checked(&c, &gw.url, &engine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_checks_keys_and_limits_behind_envoy() {
    let c = common::client();
    let engine = Proc::engine(&["--dp-size", "2", "--api-key", "engine-key"]);
    let config = config_file("epp.toml", &format!("{}{}", keyed_worker(&engine), clients()));
    let picker = Picker::start(&[], &["--config", &config]);
    let envoy = Envoy::start("clients", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    keyed_clients_are_checked(&c, &envoy.url, &engine).await;
}

/// A keyed client's key never reaches an engine, even one that would take it; with no client configured, a
/// client's `Authorization` goes through as it came (an engine's own `--api-key` checks it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_key_never_reaches_the_engine() {
    let c = common::client();
    // An engine whose key is alice's: only a gateway that passed hers on would get in.
    let engine = Proc::engine(&["--dp-size", "1", "--api-key", "key-alice"]);
    let worker = format!("[[workers]]\nurl = \"{}\"\ndp_size = 1\n", engine.url);
    let keyed = config_file("withheld.toml", &format!("{worker}{}", clients()));
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", &keyed]);
    let alice = bearer("key-alice");
    let url = format!("{}/v1/chat/completions", gw.url);
    let reply = post(&c, &url, &[("authorization", &alice)], &chat("dprouter/mock")).await;
    assert_eq!(reply.status, 401, "{}", reply.text);
    assert_eq!(
        reply.json["error"], "Unauthorized",
        "the engine's own refusal: {}",
        reply.text
    );
    let open = config_file("open.toml", &worker);
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", &open]);
    let url = format!("{}/v1/chat/completions", gw.url);
    let reply = post(&c, &url, &[("authorization", &alice)], &chat("dprouter/mock")).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
}
