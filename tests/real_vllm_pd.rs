//! Prefill/decode disaggregation with a real vLLM pair: `dprouter serve --backend vllm --prefill P --decode D` in
//! front of two vLLM CPU-build servers (SmolLM2-135M, one rank each, `scripts/vllm_engine.py`), paired by vLLM's
//! `ExampleConnector` (the connector once called `SharedStorageConnector`: the prefill server, `kv_producer`, writes
//! each prompt's KV blocks to a shared directory; the decode server, `kv_consumer`, loads the blocks it finds there
//! instead of computing them). Plain torch, so it runs on the CPU build; NIXL's connector does not install here
//! (docs/disaggregation.md). Both servers start once for this test binary, side by side (about 7 GB).
//!
//! The evidence that a prompt went through the prefill server and its KV through the directory: the decode server
//! reports the blocks it loaded as cached tokens (`usage.prompt_tokens_details`) on a prompt it has never seen,
//! where alone it reports none; whole 128-token blocks only.
//!
//! Needs Python 3.11+ and the package index the first time (as `tests/real_vllm.rs`); skipped, with a message,
//! only when the package index cannot be reached at all.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use common::engines::VllmEngine;
use common::{client, get, in_flight, post, Proc};
use hyper::StatusCode;
use serde_json::json;

/// The prefill and decode servers, and the directory their KV goes through.
struct Pair {
    prefill: VllmEngine,
    decode: VllmEngine,
    storage: PathBuf,
}

/// The pair, started by the first caller; `None` when vLLM cannot be installed here.
fn pair() -> Option<&'static Pair> {
    static PAIR: OnceLock<Option<Pair>> = OnceLock::new();
    PAIR.get_or_init(|| {
        common::engines::vllm_python()?;
        let storage = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("real-vllm-pd-kv");
        let _ = std::fs::remove_dir_all(&storage);
        std::fs::create_dir_all(&storage).unwrap();
        let config = |role: &str| {
            json!({"kv_connector": "ExampleConnector", "kv_role": role,
                   "kv_connector_extra_config": {"shared_storage_path": storage}})
            .to_string()
        };
        let (producer, consumer) = (config("kv_producer"), config("kv_consumer"));
        let (prefill, decode) = std::thread::scope(|s| {
            let prefill = s.spawn(|| VllmEngine::start_serving(1, &["--kv-transfer-config", &producer]));
            let decode = s.spawn(|| VllmEngine::start_serving(1, &["--kv-transfer-config", &consumer]));
            (prefill.join().unwrap(), decode.join().unwrap())
        });
        Some(Pair {
            prefill: prefill?,
            decode: decode?,
            storage,
        })
    })
    .as_ref()
}

/// A gateway pairing the two.
fn gateway(pair: &Pair) -> Proc {
    let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
    let mut command = Command::new(bin);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "vllm"])
        .args(["--prefill", &pair.prefill.url, "--decode", &pair.decode.url])
        .env("RUST_LOG", "warn")
        .stderr(Stdio::inherit());
    Proc::spawn(command)
}

/// A prompt of some 400 tokens no other test sends: three whole blocks and more.
fn prompt(topic: &str) -> String {
    let mut text = format!("A report on {topic}.\n");
    for i in 0..30 {
        text.push_str(&format!(
            "Item {i} of the {topic} ledger holds a balance of {} coins.\n",
            i * 37
        ));
    }
    text
}

fn cached(reply: &common::Reply) -> u64 {
    common::cached_tokens(reply).unwrap_or_else(|| panic!("no usage in {}", reply.text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_server_takes_the_prompts_kv_from_the_prefill_server() {
    let Some(pair) = tokio::task::spawn_blocking(pair).await.unwrap() else {
        eprintln!("skipped: vLLM cannot be installed here (no package index)");
        return;
    };
    let c = client();
    // Alone, the decode server computes a new prompt itself: nothing cached.
    let alone = json!({"model": "smollm2", "prompt": prompt("alone"), "max_tokens": 4});
    let reply = post(&c, &format!("{}/v1/completions", pair.decode.url), &[], &alone).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(cached(&reply), 0, "{}", reply.text);

    let gw = gateway(pair);
    for (topic, stream) in [("grain", false), ("timber", true)] {
        let mut body = json!({"model": "smollm2", "prompt": prompt(topic), "max_tokens": 4, "stream": stream});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        assert!(
            reply.headers.contains_key("x-dprouter-prefill-endpoint"),
            "no prefill leg: {:?}",
            reply.headers
        );
        // The prompt's whole blocks (some 400 tokens: at least two) came from the prefill server's directory.
        assert!(cached(&reply) >= 256, "{}", reply.text);
    }
    assert!(
        std::fs::read_dir(&pair.storage).unwrap().next().is_some(),
        "the prefill server wrote no KV"
    );
    // The prefill server answered the gateway's prefill legs: its own request counter says so.
    let metrics = get(&c, &format!("{}/metrics", pair.prefill.url)).await.text;
    let served: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(served >= 2.0, "the prefill server served {served} requests:\n{metrics}");
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}
