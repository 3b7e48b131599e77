//! End-to-end: a real Envoy (1.40, from PyPI) in front of `dprouter epp` replicas, with mock engines as the pool.
//! Envoy's own header `x-upstream-address` (`%UPSTREAM_REMOTE_ADDRESS%`, `deploy/envoy.yaml`) says where it
//! connected and the engine's `x-dp-rank` which rank served: both must be what the picker chose
//! (`x-dprouter-endpoint`).
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::envoy::Envoy;
use common::picker::Picker;
use common::{client, get, post, send, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

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
    routes_as_the_picker_chose(false).await;
}

/// The same with Envoy and the picker on mutual TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_envoy_sends_each_request_where_the_picker_chose() {
    routes_as_the_picker_chose(true).await;
}

async fn routes_as_the_picker_chose(mtls: bool) {
    let a = Proc::engine(&["--dp-size", "2"]);
    let b = Proc::engine(&["--dp-size", "2"]);
    let engines = [&a, &b];
    let envoy_and_picker = if mtls {
        let (config, edit) = mutual_tls("routes");
        let picker = Picker::start(&engines, &["--policy", "round_robin", "--config", &config]);
        (Envoy::start_edited("routes-mtls", &[&picker.grpc], edit).await, picker)
    } else {
        let picker = Picker::start(&engines, &["--policy", "round_robin"]);
        (Envoy::start("routes", &[&picker.grpc]).await, picker)
    };
    let (envoy, picker) = envoy_and_picker;
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

/// The picker's gRPC port with mutual TLS (`server.tls_cert_file`, `tls_key_file`, `tls_client_ca_file`): Envoy,
/// presenting a client certificate the CA issued and checking the picker's, routes as in plaintext (its health
/// checks too); a client without a certificate does not get through the handshake.
/// Mutual TLS between Envoy and the picker, with certificates of a CA made for `name`: the picker's config file
/// (its certificate, key and the CA its clients' certificates must come from), and the edit that gives Envoy's
/// picker cluster its client certificate and the CA it checks the picker's against.
fn mutual_tls(name: &str) -> (String, impl FnOnce(String) -> String) {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("epp-mtls-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path.display().to_string()
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Names of their own: with rcgen's one default name, a leaf would look self-signed to BoringSSL.
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "dprouter test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let issue = |name: &str, usage| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        (params.signed_by(&key, &ca, &ca_key).unwrap(), key)
    };
    let (picker_cert, picker_key) = issue("picker.dprouter.test", ExtendedKeyUsagePurpose::ServerAuth);
    let (envoy_cert, envoy_key) = issue("envoy.dprouter.test", ExtendedKeyUsagePurpose::ClientAuth);
    let ca_file = write("ca.pem", ca.pem());
    let config = write(
        "epp.toml",
        format!(
            "[server]\ntls_cert_file = {:?}\ntls_key_file = {:?}\ntls_client_ca_file = {ca_file:?}\n",
            write("picker.pem", picker_cert.pem()),
            write("picker.key", picker_key.serialize_pem()),
        ),
    );
    let tls_context = format!(
        "    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: picker.dprouter.test\n        common_tls_context:\n          alpn_protocols: [h2]\n          tls_certificates:\n          - certificate_chain: {{ filename: {:?} }}\n            private_key: {{ filename: {:?} }}\n          validation_context:\n            trusted_ca: {{ filename: {ca_file:?} }}\n            match_typed_subject_alt_names:\n            - san_type: DNS\n              matcher: {{ exact: picker.dprouter.test }}\n",
        write("envoy.pem", envoy_cert.pem()),
        write("envoy.key", envoy_key.serialize_pem()),
    );
    let edit = move |config: String| {
        let cluster = "  - name: picker\n    type: STATIC\n";
        assert!(config.contains(cluster), "deploy/envoy.yaml changed its picker cluster");
        config.replacen(cluster, &format!("{cluster}{tls_context}"), 1)
    };
    (config, edit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_talks_to_the_picker_over_mutual_tls() {
    let (config, edit) = mutual_tls("plain");
    let a = Proc::engine(&["--dp-size", "2"]);
    let engines = [&a];
    let picker = Picker::start(&engines, &["--config", &config]);
    let envoy = Envoy::start_edited("mtls", &[&picker.grpc], edit).await;
    envoy.wait_for_healthy_pickers(1).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.url);
    for n in 0..4 {
        let reply = post(&c, &url, &[], &chat(n, "You are terse.")).await;
        check_route(&reply, &engines);
    }
    // A plaintext client is closed without an HTTP/2 answer (at most a TLS alert). Without a client certificate,
    // the handshake fails: the gateway's `http::tls` unit test.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut plain = tokio::net::TcpStream::connect(&picker.grpc).await.unwrap();
    plain
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut answer))
        .await
        .expect("closed")
        .unwrap_or_default();
    assert!(answer.is_empty() || answer[0] == 0x15, "not a TLS alert: {answer:?}");
}

/// Envoy's config with OpenTelemetry tracing (every request) to the collector at `port` over gRPC.
fn with_tracing(port: u16) -> impl FnOnce(String) -> String {
    move |config| {
        let tracing = "          stat_prefix: llm\n          tracing:\n            random_sampling: { value: 100 }\n            provider:\n              name: envoy.tracers.opentelemetry\n              typed_config:\n                \"@type\": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig\n                grpc_service: { envoy_grpc: { cluster_name: otlp }, timeout: 1s }\n                service_name: envoy\n";
        let cluster = format!(
            "  clusters:\n  - name: otlp\n    type: STATIC\n    connect_timeout: 1s\n    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config: {{ http2_protocol_options: {{}} }}\n    load_assignment:\n      cluster_name: otlp\n      endpoints:\n      - lb_endpoints:\n        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}\n"
        );
        assert!(config.contains("          stat_prefix: llm\n") && config.contains("  clusters:\n"));
        config
            .replace("          stat_prefix: llm\n", tracing)
            .replacen("  clusters:\n", &cluster, 1)
    }
}

/// Tracing through Envoy: Envoy traces every request (its OpenTelemetry tracer) and the picker exports its spans,
/// both to the test's collector. A request sent with a client's `traceparent` makes one trace, in which the
/// picker's span is a child of Envoy's span for the ext_proc call and carries the routing facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_span_joins_the_trace_envoy_started() {
    let (collector, endpoint) = common::otlp::grpc_collector().await;
    let engine = Proc::engine(&["--dp-size", "2"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("epp-tracing.toml");
    let toml = format!("[tracing]\nendpoint = {endpoint:?}\nservice_name = \"dprouter-epp\"\nschedule_delay_ms = 50\n");
    std::fs::write(&config, toml).unwrap();
    let picker = Picker::start(
        &[&engine],
        &["--policy", "round_robin", "--config", config.to_str().unwrap()],
    );
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let envoy = Envoy::start_edited("tracing", &[&picker.grpc], with_tracing(port)).await;
    envoy.wait_for_healthy_pickers(1).await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace}-b7ad6b7169203331-01");
    let url = format!("{}/v1/chat/completions", envoy.url);
    let reply = post(
        &client(),
        &url,
        &[("traceparent", traceparent.as_str())],
        &chat(0, "You are terse."),
    )
    .await;
    check_route(&reply, &[&engine]);
    // The picker's span and its parent, Envoy's: Envoy sends its spans every few seconds.
    let found = common::eventually(Duration::from_secs(30), || {
        let spans = collector.spans();
        async move {
            let of_trace = || spans.iter().filter(|(_, s)| common::otlp::hex(&s.trace_id) == trace);
            of_trace()
                .any(|(service, s)| service == "dprouter-epp" && of_trace().any(|(_, p)| p.span_id == s.parent_span_id))
        }
    })
    .await;
    let spans = collector.spans();
    let report = format!("{spans:#?}");
    assert!(found, "no picker span under an Envoy span in trace {trace}: {report}");
    let (_, picked) = spans
        .iter()
        .find(|(service, s)| service == "dprouter-epp" && common::otlp::hex(&s.trace_id) == trace)
        .unwrap();
    let (parent_service, parent) = spans.iter().find(|(_, p)| p.span_id == picked.parent_span_id).unwrap();
    assert_eq!(parent_service, "envoy", "{report}");
    assert_ne!(
        common::otlp::hex(&picked.parent_span_id),
        "b7ad6b7169203331",
        "the picker joined Envoy's span, not the client's: {report}"
    );
    eprintln!("the picker's span under Envoy's {:?}", parent.name);
    // Envoy resets a finished ext_proc stream: that is no failure of the request (status code 2 is an error).
    let status = picked.status.as_ref().map(|s| (s.code, s.message.clone()));
    assert!(
        status.as_ref().is_none_or(|(code, _)| *code != 2),
        "the picker's span says the request failed: {status:?}"
    );
    let a = &picked.attributes;
    let (_, rank) = label_of(&reply);
    assert_eq!(picked.name, "POST /v1/chat/completions", "{report}");
    assert_eq!(common::otlp::int(a, "dprouter.rank"), Some(i64::from(rank)), "{report}");
    assert_eq!(
        common::otlp::string(a, "dprouter.policy").as_deref(),
        Some("round_robin")
    );
    assert_eq!(common::otlp::int(a, "http.response.status_code"), Some(200), "{report}");
    assert_eq!(
        common::otlp::int(a, "gen_ai.usage.input_tokens"),
        reply.json["usage"]["prompt_tokens"].as_i64(),
        "{report}"
    );
}

/// The one header rule (`crates/gateway/src/pipeline/engine_headers.rs`): the same client request reaches the
/// engine with the same client-sent headers through `serve` and through Envoy asking the picker. Headers the data
/// plane adds itself (`x-forwarded-*`, `x-envoy-*`, the picker's `x-gateway-destination-endpoint`) and the
/// transport's (`host`, `content-length`, `transfer-encoding`) do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_gets_the_same_client_headers_through_serve_and_through_envoy() {
    use common::scripted::{header_names, Act, Scripted};
    let engine = Scripted::start(Act::Json(r#"{"choices": [{"text": "ok"}]}"#)).await;
    let worker = ["--worker", engine.url.as_str(), "--backend", "openai"];
    let gw = Proc::start(&[&["serve", "--listen", "127.0.0.1:0"][..], &worker].concat());
    let picker = Picker::start(&[], &worker);
    let envoy = Envoy::start("engine-headers", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    let c = client();
    let sent = [
        ("accept", "application/json"),
        ("user-agent", "header-rule-test/1"),
        ("x-request-id", "header-rule-1"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "tools-2024-04-04"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("authorization", "Bearer client-key"),
        ("x-api-key", "client-key"),
        ("cookie", "session=secret"),
        ("proxy-authorization", "Basic secret"),
        ("x-session-id", "s-1"),
        ("x-claude-code-session-id", "c-1"),
        ("x-custom-header", "anything"),
        ("accept-encoding", "gzip"),
        ("x-gateway-destination-endpoint-served", "10.9.9.9:1"),
        ("x-prefiller-host-port", "10.9.9.9:2"),
    ];
    let body = json!({"model": "m", "prompt": "same headers", "max_tokens": 2});
    let transport = |n: &str| {
        matches!(n, "host" | "content-length" | "transfer-encoding" | "connection" | "te")
            || n.starts_with("x-forwarded-")
            || n.starts_with("x-envoy-")
            || n == "x-gateway-destination-endpoint"
    };
    let mut seen = Vec::new();
    for front in [&gw.url, &envoy.url] {
        let reply = post(&c, &format!("{front}/v1/completions"), &sent, &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{front}: {}", reply.text);
        let (head, _) = engine.posts().pop().unwrap();
        let mut names: Vec<String> = header_names(&head).into_iter().filter(|n| !transport(n)).collect();
        names.sort();
        names.dedup();
        seen.push(names);
    }
    let expected = [
        "accept",
        "anthropic-beta",
        "anthropic-version",
        "authorization",
        "content-type",
        "traceparent",
        "user-agent",
        "x-request-id",
    ];
    assert_eq!(seen[0], expected, "through serve");
    assert_eq!(seen[1], expected, "through Envoy and the picker");
}

/// Anthropic's Messages API behind Envoy: each turn goes where the picker chose (the rank in SGLang's
/// `routed_dp_rank`), an agent's later turns to the rank holding its prefix; `count_tokens` is answered by an
/// engine; the picker's own refusal of a malformed body is in Anthropic's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_go_through_envoy_where_the_picker_chose() {
    let a = Proc::engine(&["--dp-size", "2"]);
    let picker = Picker::start(&[&a], &["--policy", "cache_aware"]);
    let envoy = Envoy::start("messages", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    let c = client();
    let url = format!("{}/v1/messages", envoy.url);
    let system = format!("You are an agent. {}", "Keep answers short. ".repeat(40));
    for agent in 0..2 {
        let mut messages = Vec::new();
        let mut home = None;
        for turn in 0..3 {
            messages.push(
                json!({"role": "user", "content": [{"type": "text", "text": format!("agent {agent} step {turn}")}]}),
            );
            let body = json!({"model": "dprouter/mock", "max_tokens": 4, "system": system, "messages": messages, "stream": turn == 1});
            let reply = post(&c, &url, &[("anthropic-version", "2023-06-01")], &body).await;
            check_route(&reply, &[&a]);
            let rank = header(&reply, "x-dp-rank").to_string();
            match &home {
                None => home = Some(rank),
                Some(home) => assert_eq!(&rank, home, "agent {agent} turn {turn} left its rank"),
            }
            messages.push(json!({"role": "assistant", "content": [{"type": "text", "text": "ok"}]}));
        }
    }
    let count = json!({"model": "dprouter/mock", "messages": [{"role": "user", "content": "count me"}]});
    let reply = post(&c, &format!("{url}/count_tokens"), &[], &count).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert!(reply.json["input_tokens"].as_u64().unwrap() > 0, "{}", reply.text);
    let reply = post(&c, &url, &[], &json!({"model": "dprouter/mock", "messages": 7})).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
    assert_eq!(reply.json["type"], "error", "{}", reply.text);
    assert_eq!(reply.json["error"]["type"], "invalid_request_error", "{}", reply.text);
}
