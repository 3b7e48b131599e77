//! Hardening 4, end to end through the real processes: what a hostile client, a hostile peer of the picker's gRPC
//! port and a hostile Kubernetes API server can no longer do (docs/operations.md, "What the gateway does not take").
//! Scripted engines record what reaches them, so a test can show that a client's field, secret or string did not.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::picker::Picker;
use common::scripted::{Act, Scripted};
use common::{client, eventually, get, post, Proc};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The value of the counter `dprouter_refused_input_total{what="WHAT"}` on `/metrics` (0 when absent).
async fn refused(c: &common::HttpClient, url: &str, what: &str) -> u64 {
    let text = get(c, &format!("{url}/metrics")).await.text;
    let needle = format!("dprouter_refused_input_total{{what=\"{what}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map_or(0, |v| v.trim().parse().unwrap())
}

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": "m", "prompt": "hello there", "max_tokens": 2});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A `dprouter decode-sidecar` in front of `decode`, with `extra` flags.
fn sidecar(decode: &Scripted, extra: &[&str]) -> Proc {
    let mut args = vec!["decode-sidecar", "--listen", "127.0.0.1:0", "--decode", &decode.url];
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// F3: the decode sidecar sends a prefill leg only to an allowed endpoint, with none of the client's secrets, and
/// never lets a client's pairing fields steer a KV transfer; a prefill server's error is passed on clipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_sidecar_trusts_only_allowed_prefill_endpoints_and_drops_client_secrets_and_pairing_fields() {
    let c = client();
    let decode = Scripted::start(Act::Json(r#"{"choices": [{"text": "ok"}]}"#)).await;
    let prefill = Scripted::start(Act::Json(
        r#"{"choices": [{"text": "p"}], "kv_transfer_params": {"remote_engine_id": "from-prefill"}}"#,
    ))
    .await;
    let at = prefill.url.trim_start_matches("http://").to_string();
    let secrets = [
        ("authorization", "Bearer client-secret"),
        ("x-api-key", "client-secret"),
        ("cookie", "session=client-secret"),
    ];
    let mut headers = vec![("x-prefiller-host-port", at.as_str())];
    headers.extend(secrets);
    let steering = completion(json!({"kv_transfer_params": {"remote_host": "10.9.9.9"}, "bootstrap_host": "10.9.9.9"}));

    // No allow-list: refused, and nothing reaches the named address.
    let open = sidecar(&decode, &["--backend", "vllm"]);
    let reply = post(&c, &format!("{}/v1/completions", open.url), &headers, &steering).await;
    assert_eq!(reply.status, 403, "{}", reply.text);
    assert!(reply.text.contains("--prefill-allow"), "{}", reply.text);
    assert!(prefill.posts().is_empty() && decode.posts().is_empty());

    // Allowed: the legs carry the sidecar's own key, no client secret, and the prefill's pairing only.
    let key = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hardening-engine-key");
    std::fs::write(&key, "engine-key\n").unwrap();
    let allowed = sidecar(
        &decode,
        &[
            "--backend",
            "vllm",
            "--prefill-allow",
            &format!("10.0.0.0/8,127.0.0.1:{}", prefill.port()),
            "--api-key-file",
            key.to_str().unwrap(),
        ],
    );
    let url = format!("{}/v1/completions", allowed.url);
    let reply = post(&c, &url, &headers, &steering).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let (prefill_head, prefill_body) = prefill.posts().pop().unwrap();
    let (decode_head, decode_body) = decode.posts().pop().unwrap();
    for (leg, head, body) in [
        ("prefill", &prefill_head, &prefill_body),
        ("decode", &decode_head, &decode_body),
    ] {
        assert!(
            !head.contains("client-secret"),
            "the {leg} leg got a client secret: {head}"
        );
        assert!(head.contains("authorization: bearer engine-key"), "{leg}: {head}");
        assert!(
            !body.contains("10.9.9.9"),
            "the {leg} leg got the client's pairing: {body}"
        );
    }
    let decode_json: Value = serde_json::from_str(&decode_body).unwrap();
    assert_eq!(decode_json["kv_transfer_params"]["remote_engine_id"], "from-prefill");

    // A request for the decode server alone loses its pairing fields too.
    let reply = post(&c, &url, &secrets, &steering).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let (head, body) = decode.posts().pop().unwrap();
    assert!(
        !body.contains("10.9.9.9") && !body.contains("kv_transfer_params"),
        "{body}"
    );
    assert!(!head.contains("client-secret"), "{head}");

    // A prefill server's 4xx reaches the client clipped.
    let refusing = Scripted::start(Act::Status(400, 100_000)).await;
    let at = refusing.url.trim_start_matches("http://").to_string();
    let reply = post(
        &c,
        &url,
        &[("x-prefiller-host-port", at.as_str())],
        &completion(json!({})),
    )
    .await;
    assert_eq!(
        reply.status, 403,
        "10.0.0.0/8 and one port of 127.0.0.1 only: {}",
        reply.text
    );
    let clipping = sidecar(&decode, &["--backend", "vllm", "--prefill-allow", "127.0.0.1"]);
    let reply = post(
        &c,
        &format!("{}/v1/completions", clipping.url),
        &[("x-prefiller-host-port", at.as_str())],
        &completion(json!({})),
    )
    .await;
    assert_eq!(reply.status, 400, "{}", reply.text);
    assert!(reply.text.len() < 5_000, "{} bytes reflected", reply.text.len());

    // SGLang: bootstrap fields that do not name the header's prefill endpoint are not the picker's: a fresh room.
    let sglang = sidecar(&decode, &["--prefill-allow", "127.0.0.1"]);
    let at = prefill.url.trim_start_matches("http://").to_string();
    let body = completion(json!({"bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "bootstrap_room": 5}));
    let reply = post(
        &c,
        &format!("{}/generate", sglang.url),
        &[("x-prefiller-host-port", at.as_str())],
        &body,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let decode_json: Value = serde_json::from_str(&decode.posts().pop().unwrap().1).unwrap();
    assert_eq!(decode_json["bootstrap_host"], "127.0.0.1", "{decode_json}");
    assert_ne!(decode_json["bootstrap_room"], 5, "{decode_json}");
}

/// The sidecar reads a body as `serve` does: one trickled a byte a second is cut at the body timeout (a 408).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_sidecar_cuts_a_trickled_body() {
    let decode = Scripted::start(Act::Json(r#"{"choices": [{"text": "ok"}]}"#)).await;
    let sidecar = sidecar(&decode, &["--request-body-timeout-ms", "1500"]);
    let mut socket = TcpStream::connect(sidecar.url.trim_start_matches("http://"))
        .await
        .unwrap();
    let head =
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    socket.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    for _ in 0..10 {
        if socket.write_all(b" ").await.is_err() {
            break;
        }
        let mut buf = [0u8; 4096];
        match tokio::time::timeout(Duration::from_secs(1), socket.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                answer.extend_from_slice(&buf[..n]);
                break;
            }
            Ok(_) => break,
            Err(_) => {}
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert!(decode.posts().is_empty());
}

/// F6: a client's `kv_transfer_params`, `bootstrap_host`, `bootstrap_port` and `disagg_prefill_dp_rank` never reach
/// an aggregated engine; its `bootstrap_room` does (`follow_bootstrap_room` routes by it). Counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_never_passes_a_clients_kv_transfer_fields_to_an_engine() {
    let c = client();
    let engine = Scripted::start(Act::Json(r#"{"choices": [{"text": "ok"}]}"#)).await;
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--worker",
        &engine.url,
        "--backend",
        "vllm",
        "--dp-size",
        "2",
    ]);
    let steering = completion(
        json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.9.9.9"},
        "bootstrap_host": "10.9.9.9", "bootstrap_port": 1, "disagg_prefill_dp_rank": 1, "bootstrap_room": 77}),
    );
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let mut body = steering.clone();
        if path.contains("chat") {
            body["messages"] = json!([{"role": "user", "content": "hi"}]);
            body.as_object_mut().unwrap().remove("prompt");
        }
        let reply = post(&c, &format!("{}{path}", gw.url), &[], &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let (_, seen) = engine.posts().pop().unwrap();
        let seen: Value = serde_json::from_str(&seen).unwrap();
        for field in [
            "kv_transfer_params",
            "bootstrap_host",
            "bootstrap_port",
            "disagg_prefill_dp_rank",
        ] {
            assert!(seen.get(field).is_none(), "{path}: {field} reached the engine: {seen}");
        }
        assert_eq!(seen["bootstrap_room"], 77, "{seen}");
    }
    assert_eq!(refused(&c, &gw.url, "client_field").await, 2);
}

/// F2: a client's `model` is clipped in the access log (and the spans: the same value), not copied whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_long_model_name_is_clipped_in_the_access_log() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    let (gw, log) = Proc::logging_access(&engine, "hardening-access-log");
    let c = client();
    let model = "m".repeat(1 << 20);
    let body = json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let reply = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url),
        &[("x-request-id", "long-model")],
        &body,
    )
    .await;
    assert_eq!(reply.status, 200, "{:.300}", reply.text);
    let logged = eventually(Duration::from_secs(5), || async {
        std::fs::read_to_string(&log).unwrap().contains("request_id=long-model")
    })
    .await;
    assert!(logged, "no access log line");
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text.lines().find(|l| l.contains("request_id=long-model")).unwrap();
    assert!(line.len() < 2_000, "an access log line of {} bytes", line.len());
    assert!(line.contains(&format!("model=\"{}…\"", "m".repeat(256))), "{line:.600}");
    assert_eq!(refused(&c, &gw.url, "client_string").await, 1);
}

/// The gateway in front of a prefill and a decode server, both scripted.
fn disaggregated(prefill: &Scripted, decode: &Scripted, backend: &str, extra: &[&str]) -> Proc {
    let prefill = if backend == "sglang" {
        format!("{}:1", prefill.url)
    } else {
        prefill.url.clone()
    };
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--backend",
        backend,
        "--prefill",
        &prefill,
        "--decode",
        &decode.url,
    ];
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// The `dprouter_upstream_errors_total` lines of `kind="timeout"`.
async fn timeouts(c: &common::HttpClient, url: &str) -> Vec<String> {
    let text = get(c, &format!("{url}/metrics")).await.text;
    text.lines()
        .filter(|l| l.starts_with("dprouter_upstream_errors_total") && l.contains("kind=\"timeout\""))
        .map(str::to_string)
        .collect()
}

/// F4: a prefill server that never answers uses its own share of the first-byte budget: under SGLang the client's
/// 504 names it and its endpoint is blamed, not the decode one; under vLLM the decode server prefills the prompt in
/// the time left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_never_answers_is_named_and_blamed_and_leaves_the_decode_leg_time() {
    let c = client();
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hardening-first-byte.toml");
    std::fs::write(&config, "first_byte_timeout_ms = 3000\n").unwrap();
    let config = config.to_str().unwrap();

    // SGLang: the decode server waits for the KV cache the prefill never sends.
    let prefill = Scripted::start(Act::Hang).await;
    let decode = Scripted::start(Act::Hang).await;
    let gw = disaggregated(&prefill, &decode, "sglang", &["--config", config]);
    let started = Instant::now();
    let reply = post(
        &c,
        &format!("{}/generate", gw.url),
        &[],
        &json!({"text": "hello", "sampling_params": {}}),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(reply.status, 504, "{}", reply.text);
    let message = reply.json["error"]["message"].as_str().unwrap().to_string();
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(workers["workers"][0]["url"], prefill.url.as_str(), "{workers}");
    assert!(message.contains("w0r0"), "the prefill endpoint is named: {message}");
    assert!(message.contains("1500 ms"), "half the request's 3000 ms: {message}");
    assert!(took < Duration::from_millis(2900), "{took:?}");
    let timeouts = timeouts(&c, &gw.url).await;
    assert!(
        timeouts.len() == 1 && timeouts[0].contains("endpoint=\"w0r0\""),
        "only the prefill endpoint is blamed: {timeouts:?}"
    );

    // vLLM: the prefill leg first, then the decode server alone in the time left.
    let prefill = Scripted::start(Act::Hang).await;
    let decode = Scripted::start(Act::Json(r#"{"choices": [{"text": "ok"}]}"#)).await;
    let gw = disaggregated(&prefill, &decode, "vllm", &["--config", config]);
    let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &completion(json!({}))).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(decode.posts().len(), 1);
}

/// F5: a prefill leg still streaming after the decode answer ended is cut a few seconds later
/// (`DETACHED_PREFILL_GRACE`, 5 s), not held in flight for the stream idle timeout (300 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_that_stalls_after_the_answer_ended_is_cut() {
    let c = client();
    let prefill = Scripted::start(Act::SseThenStall).await;
    let decode = Scripted::start(Act::Json(r#"{"text": "ok", "meta_info": {}}"#)).await;
    let gw = disaggregated(&prefill, &decode, "sglang", &[]);
    let reply = post(
        &c,
        &format!("{}/generate", gw.url),
        &[],
        &json!({"text": "hello", "stream": true}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let ended = Instant::now();
    assert_eq!(
        common::in_flight(&c, &gw.url).await,
        1,
        "the prefill leg goes on a while"
    );
    let released = eventually(Duration::from_secs(15), || async {
        common::in_flight(&c, &gw.url).await == 0
    })
    .await;
    assert!(released, "the stalled prefill leg still counted in flight");
    assert!(
        ended.elapsed() >= Duration::from_secs(4),
        "cut after its grace: {:?}",
        ended.elapsed()
    );
    assert_eq!(refused(&c, &gw.url, "prefill_leg_cut").await, 1);
}

/// F7: one keyed client's many Responses cannot push out another's (each keeps a fair share of the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_push_out_anothers_stored_responses() {
    let c = client();
    let engine = Proc::engine(&["--dp-size", "2"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hardening-responses.toml");
    // `printf %s key-NAME | sha256sum` for alice and bob.
    std::fs::write(
        &config,
        r#"remembered_responses = 8
[[clients]]
name = "alice"
key_sha256 = "87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef"
[[clients]]
name = "bob"
key_sha256 = "f031fc74d10cf0c1284dc15f679c18b1e8e05f9d1966adefba6c6463cdcef658"
"#,
    )
    .unwrap();
    let gw = Proc::gateway(
        &[&engine],
        &["--policy", "round_robin", "--config", config.to_str().unwrap()],
    );
    let url = format!("{}/v1/responses", gw.url);
    let turn = |previous: Option<&str>| {
        let mut body = json!({"model": "m", "input": "hello", "max_output_tokens": 2});
        if let Some(id) = previous {
            body["previous_response_id"] = json!(id);
        }
        body
    };
    let alice = [("authorization", "Bearer key-alice")];
    let bob = [("authorization", "Bearer key-bob")];
    let first = post(&c, &url, &alice, &turn(None)).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let id = first.json["id"].as_str().unwrap().to_string();
    let mut bobs = Vec::new();
    for _ in 0..20 {
        let reply = post(&c, &url, &bob, &turn(None)).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        bobs.push(reply.json["id"].as_str().unwrap().to_string());
    }
    let next = post(&c, &url, &alice, &turn(Some(&id))).await;
    assert_eq!(
        next.status, 200,
        "alice's conversation survives bob's 20: {}",
        next.text
    );
    // Bob's own oldest went first.
    let old = post(&c, &url, &bob, &turn(Some(&bobs[0]))).await;
    assert_eq!(old.status, 404, "{}", old.text);
}

/// F8: with `trust_unkeyed_objectives = false`, a request without a key cannot name its objective (counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_objectives_can_be_ignored() {
    let c = client();
    let engine = Proc::engine(&["--dp-size", "2"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hardening-objectives.toml");
    std::fs::write(
        &config,
        "[flow_control]\nenabled = true\ntrust_unkeyed_objectives = false\nobjectives = { critical = 10 }\n",
    )
    .unwrap();
    let gw = Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let body = json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let url = format!("{}/v1/chat/completions", gw.url);
    let reply = post(&c, &url, &[("x-gateway-inference-objective", "critical")], &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(refused(&c, &gw.url, "unkeyed_objective").await, 1);
}

#[path = "hardening/ext_proc.rs"]
mod ext_proc;

/// F1: a hostile Kubernetes API server's LIST costs what discovery keeps, not what it sends: 2,000,000 empty
/// items (a page far larger than the 500 asked for) are refused as they are read, and a server that keeps sending
/// `continue` is refused after `MAX_LIST_PAGES`. The gateway's peak memory stays under 150 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_kubernetes_list_costs_bounded_memory() {
    let c = client();
    for hostile in ["huge_page", "endless_pages"] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = format!("http://{}", listener.local_addr().unwrap());
        let page: Arc<Vec<u8>> = Arc::new(match hostile {
            "huge_page" => {
                let mut items = b"{\"metadata\": {\"resourceVersion\": \"1\"}, \"items\": [".to_vec();
                for i in 0..2_000_000 {
                    items.extend_from_slice(if i == 0 { b"{}" } else { b",{}" });
                }
                items.extend_from_slice(b"]}");
                items
            }
            _ => br#"{"metadata": {"resourceVersion": "1", "continue": "again"}, "items": [{}]}"#.to_vec(),
        });
        let lists = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (served, counter) = (Arc::clone(&page), Arc::clone(&lists));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let _ = socket.set_nodelay(true);
                let (page, counter) = (Arc::clone(&served), Arc::clone(&counter));
                tokio::spawn(async move {
                    while let Some((head, _)) = common::read_head(&mut socket).await {
                        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if head.contains("watch=true") {
                            return;
                        }
                        let mut out = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            page.len()
                        )
                        .into_bytes();
                        out.extend_from_slice(&page);
                        if socket.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hardening-{hostile}.toml"));
        std::fs::write(
            &config,
            format!(
                "[[discovery.kubernetes]]\npods = \"app=x\"\nport = 8000\nnamespace = \"default\"\napi_server = \
                 \"{api}\"\nworker = {{ backend = \"openai\" }}\n"
            ),
        )
        .unwrap();
        let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
        let refusals = eventually(Duration::from_secs(20), || async {
            refused(&c, &gw.url, "kubernetes_answer").await >= 1
        })
        .await;
        let peak = common::memory::peak_rss(gw.child.id());
        eprintln!(
            "{hostile}: {} KB a page, {} requests, peak RSS {} MB",
            page.len() >> 10,
            lists.load(std::sync::atomic::Ordering::Relaxed),
            peak >> 20
        );
        assert!(refusals, "{hostile}: not refused");
        assert!(peak < 150 << 20, "{hostile}: peak RSS {} MB", peak >> 20);
        if hostile == "endless_pages" {
            assert!(lists.load(std::sync::atomic::Ordering::Relaxed) >= 1_000);
        }
    }
}
