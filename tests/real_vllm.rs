//! End-to-end with a real vLLM: `dprouter serve --backend vllm` in front of vLLM's CPU build serving SmolLM2-135M
//! with `--data-parallel-size 2` (`scripts/vllm_engine.py`: installed once into a cache outside the clone, started
//! once for this whole test binary, each test from a cold prefix cache). The rank goes in `X-data-parallel-rank`;
//! vLLM's own per-engine metrics and its KV events' ranks are the evidence of where a request ran. The engine
//! caches whole 128-token blocks only, so a turn *hits* when vLLM reports (`usage.prompt_tokens_details`) at least
//! the previous turn's prompt rounded down to 128 tokens.
//!
//! Needs Python 3.11+ and the package index the first time (about 3.2 GB of wheels, 6.8 GB on disk, 5 to 10
//! minutes); skipped, with a message, only when the package index cannot be reached at all.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::conversations::{agent_pause, converse, converse_paced, hits, rank_of, summary, system_prompt};
use common::engines::VllmEngine;
use common::otlp::{hex, int};
use common::{client, eventually, get, post, Proc};
use hyper::StatusCode;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::{json, Value};

/// One test at a time on the shared engine: each starts from a cold cache, and only one gateway can bind the
/// address the engine's publishers connect to.
static ENGINE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shared engine, its prefix cache emptied; `None` (the test is skipped) when vLLM cannot be installed. A rank
/// publishes the clear (`AllBlocksCleared`) with its next step of its own, so one short request goes to each:
/// then the replay a new gateway asks for ends with it.
async fn cold_engine() -> Option<&'static VllmEngine> {
    let engine = tokio::task::spawn_blocking(VllmEngine::shared).await.unwrap()?;
    let c = client();
    let reply = post(&c, &format!("{}/reset_prefix_cache", engine.url), &[], &json!({})).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    step_each_rank(&engine.url).await;
    Some(engine)
}

/// One short request pinned to each rank at `url` (vLLM itself, or a gateway).
async fn step_each_rank(url: &str) {
    for rank in ["0", "1"] {
        let body = json!({"model": "smollm2", "prompt": "Hello.", "max_tokens": 1});
        let reply = post(
            &client(),
            &format!("{url}/v1/completions"),
            &[("x-data-parallel-rank", rank)],
            &body,
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
}

/// A gateway in front of `engine` (`--backend vllm`, two ranks) with `routing` (TOML lines of `[routing]`) and
/// `extra` lines for the worker; its log (the access log included) goes to a file, returned with it.
fn gateway(engine: &VllmEngine, name: &str, top: &str, routing: &str, extra: &str) -> (Proc, std::path::PathBuf) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let config = dir.join(format!("real-vllm-{name}.toml"));
    let log = dir.join(format!("real-vllm-{name}.log"));
    let toml = format!(
        "{top}\n[server]\naccess_log = true\n\n[routing]\n{routing}\n\n[[workers]]\nurl = {:?}\nbackend = \"vllm\"\ndp_size = 2\nkv_capacity_tokens = 20000\n{extra}\n",
        engine.url
    );
    std::fs::write(&config, toml).unwrap();
    let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
    let mut command = Command::new(bin);
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn,dprouter::access=info")
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
    (Proc::spawn(command), log)
}

/// cache_aware with the CPU engine's measured costs: about 150 prompt tokens a second per rank, and a fixed part
/// of 0.3 s (eight tokens decoded at about 8 a second are most of it).
const CACHE_AWARE: &str = "policy = \"cache_aware\"\nprefill_tokens_per_s = 150\nbase_ms = 300";

/// vLLM's prompt tokens per engine (rank), from its own metrics.
async fn engine_prompt_tokens(engine: &VllmEngine) -> HashMap<u64, u64> {
    let text = get(&client(), &format!("{}/metrics", engine.url)).await.text;
    let mut out = HashMap::new();
    for line in text.lines().filter(|l| l.starts_with("vllm:prompt_tokens_total{")) {
        let rank = line
            .split("engine=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|r| r.parse().ok());
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (Some(rank), Some(value)) = (rank, value) {
            *out.entry(rank).or_insert(0) += value as u64;
        }
    }
    out
}

/// Each answer's rank (`x-dp-rank`) is where vLLM ran it: vLLM's per-engine prompt tokens grow by exactly the
/// prompt tokens of the answers the gateway says each rank gave, and both ranks served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vllm_backend_pins_each_request_to_the_rank_it_names() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let (gw, _) = gateway(engine, "pins", "", "policy = \"round_robin\"", "");
    let before = engine_prompt_tokens(engine).await;
    let c = client();
    let mut expected: HashMap<u64, u64> = HashMap::new();
    for i in 0..6 {
        let body = json!({"model": "smollm2", "prompt": format!("Request {i}: count to three."), "max_tokens": 2});
        let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        let rank = rank_of(&reply).unwrap();
        *expected.entry(rank).or_insert(0) += reply.json["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    let after = engine_prompt_tokens(engine).await;
    let served: HashMap<u64, u64> = after
        .iter()
        .map(|(rank, n)| (*rank, n - before.get(rank).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(served, expected);
    assert_eq!(served.len(), 2, "both ranks served: {served:?}");
}

/// Four conversations at once, each with its own 400-token system prompt, four turns each: under `cache_aware`
/// every turn after a conversation's first hits its rank's cache, and the gateway's token counters are what vLLM
/// told the clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_conversations_hit_on_every_turn_under_cache_aware() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let (gw, _) = gateway(engine, "approximate", "", CACHE_AWARE, "");
    let seen = converse(&gw.url, 4, 4).await;
    eprintln!("cache_aware: {}", summary(&seen));
    let report = format!("{seen:#?}");
    for turns in &seen {
        assert!(turns[0].prompt > 300, "{report}");
        assert_eq!(hits(turns), turns.len() - 1, "{report}");
    }
    let prompt: u64 = seen.iter().flatten().map(|t| t.prompt).sum();
    let cached: u64 = seen.iter().flatten().map(|t| t.cached).sum();
    assert_eq!(
        common::token_counters(&client(), &gw.url).await,
        (prompt, cached),
        "{report}"
    );
}

/// vLLM's own balancer (no gateway, no plugin) on the conversations `tests/python_package.rs` sends through the
/// plugin: measured and printed for docs/in-engine.md, not asserted (it balances by load, not by prefix).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_balancer_on_four_conversations() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let seen = converse_paced(&engine.url, 4, 4, agent_pause).await;
    let later: usize = seen.iter().map(|turns| turns.len() - 1).sum();
    let hit: usize = seen.iter().map(|turns| hits(turns)).sum();
    eprintln!(
        "vLLM's own balancer: {hit} of {later} later turns hit; {}",
        summary(&seen)
    );
    assert!(seen.iter().all(|turns| turns[0].prompt > 300), "{seen:#?}");
}

/// The access log's requests: (cached tokens vLLM reported, cached tokens the gateway predicted).
fn predictions(log: &std::path::Path) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(log).unwrap();
    let field = |line: &str, name: &str| -> Option<u64> {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        line[at..].split(' ').next()?.parse().ok()
    };
    text.lines()
        .filter(|l| l.contains("path=/v1/chat/completions"))
        .filter_map(|l| Some((field(l, "cached_tokens")?, field(l, "predicted_cached_tokens")?)))
        .collect()
}

/// Precise mode against vLLM's own KV events, in the shape where vLLM's publishers connect and the gateway binds
/// (`kv_events_bind`), with SmolLM2's tokenizer so the gateway's keys are the engine's tokens: both ranks' feeds are
/// listed, connected and precise; four conversations of six turns hit on every later turn; the gateway predicts
/// the cached tokens vLLM reports on at least 97% of requests (whole 128-token blocks, the last block of a fully
/// cached prompt recomputed); and when vLLM's prefix cache is reset, the feeds follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_mode_follows_vllms_events_and_predicts_its_cached_tokens() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/smollm2");
    let events = format!(
        "kv_events_bind = \"tcp://127.0.0.1:{}\"\nkv_events_replay = \"tcp://127.0.0.1:{}\"",
        engine.events,
        engine.events + 100
    );
    let (gw, log) = gateway(
        engine,
        "precise",
        &format!("tokenizer = {tokenizer:?}"),
        CACHE_AWARE,
        &events,
    );
    let c = client();
    let feeds = || async { get(&c, &format!("{}/kv_events", gw.url)).await.json["feeds"].clone() };
    // Both feeds listed at once, whether or not vLLM's publishers have connected yet.
    let listed = feeds().await;
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    let connected = eventually(Duration::from_secs(30), || async {
        feeds()
            .await
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["connected"] == json!(true))
    });
    assert!(connected.await, "{}", feeds().await);
    let seen = converse(&gw.url, 4, 6).await;
    eprintln!("cache_aware, precise: {}", summary(&seen));
    let report = format!("{seen:#?}\n{}", feeds().await);
    for turns in &seen {
        assert_eq!(hits(turns), turns.len() - 1, "{report}");
    }
    // Both ranks' events were followed, with nothing lost.
    for feed in feeds().await.as_array().unwrap() {
        assert_eq!(feed["precise"], json!(true), "{feed}");
        assert!(feed["router_blocks"].as_u64().unwrap() > 0, "{feed}");
        for trouble in ["gaps", "decode_errors", "orphans", "overflows", "restarts"] {
            assert_eq!(feed[trouble], json!(0), "{trouble}: {feed}");
        }
    }
    let predicted = predictions(&log);
    assert_eq!(predicted.len(), 24, "{predicted:?}");
    let exact = predicted.iter().filter(|(cached, guess)| cached == guess).count();
    eprintln!("predicted exactly {exact} of {}: {predicted:?}", predicted.len());
    assert!(exact * 100 >= predicted.len() * 97, "{predicted:?}\n{report}");
    let held = |feeds: &Value| -> Vec<u64> {
        feeds
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["engine_blocks"].as_u64().unwrap())
            .collect()
    };
    // vLLM's cache is reset; each rank publishes the clear with its next step of its own (a rank idling while the
    // other works publishes nothing), so one short request goes to each.
    let reply = post(&c, &format!("{}/reset_prefix_cache", engine.url), &[], &json!({})).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    step_each_rank(&gw.url).await;
    let cleared = eventually(Duration::from_secs(10), || async { held(&feeds().await) == [0, 0] });
    assert!(cleared.await, "{}", feeds().await);
    // The first conversation's next turn is cold now, and predicted so.
    let mut history = vec![json!({"role": "system", "content": system_prompt(0)})];
    history.push(json!({"role": "user", "content": "Again?"}));
    let body = json!({"model": "smollm2", "messages": history, "max_tokens": 2});
    let reply = post(&c, &format!("{}/v1/chat/completions", gw.url), &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    let last = *predictions(&log).last().unwrap();
    assert_eq!(last, (0, 0), "{}", feeds().await);
}

/// Tracing through to the engine: a gateway exporting its spans and vLLM exporting its own
/// (`--otlp-traces-endpoint`), both to the test's collector. A request sent with the client's `traceparent` makes
/// one trace: the gateway's `request` span under the client's span, its `upstream` span, and vLLM's request span
/// (`llm_request`) a child of that `upstream` span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_request_span_nests_under_the_gateways_attempt_in_the_clients_trace() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let Some((collector, endpoint)) = &engine.spans else {
        eprintln!("DPROUTER_TEST_VLLM names an engine without a collector: skipped");
        return;
    };
    let tracing = format!("\n[tracing]\nendpoint = {endpoint:?}\nschedule_delay_ms = 100\n");
    let (gw, _) = gateway(engine, "tracing", "", "policy = \"round_robin\"", &tracing);
    let (trace, client_span) = ("5af7183fc1a54b5e9e1c2d3b4a596877", "1112131415161718");
    let traceparent = format!("00-{trace}-{client_span}-01");
    let body = json!({"model": "smollm2", "prompt": "Say hello.", "max_tokens": 2});
    let url = format!("{}/v1/completions", gw.url);
    let reply = post(&client(), &url, &[("traceparent", traceparent.as_str())], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    // vLLM sends its spans every 5 s (its SDK's default).
    let spans = collector.trace(trace, 3).await;
    let report = format!("{spans:#?}");
    let named = |name: &str| spans.iter().map(|(_, s)| s).find(|s| s.name == name);
    let request = named("POST /v1/completions").unwrap_or_else(|| panic!("no request span: {report}"));
    let upstream = named("upstream").unwrap_or_else(|| panic!("no upstream span: {report}"));
    assert_eq!(hex(&request.parent_span_id), client_span, "{report}");
    assert_eq!(upstream.parent_span_id, request.span_id, "{report}");
    let in_vllm = named("llm_request").unwrap_or_else(|| panic!("no span from vLLM: {report}"));
    assert_eq!(in_vllm.parent_span_id, upstream.span_id, "{report}");
    assert_eq!(in_vllm.kind, SpanKind::Server as i32, "{report}");
    assert_eq!(
        int(&request.attributes, "dprouter.rank"),
        rank_of(&reply).map(|r| r as i64),
        "{report}"
    );
    eprintln!(
        "vLLM's span {} under the gateway's upstream span {} in trace {trace}",
        hex(&in_vllm.span_id),
        hex(&upstream.span_id)
    );
}

/// Anthropic's official SDK through `serve` to vLLM's own `/v1/messages` (DP 2): four agents with Claude Code's
/// session header, four turns each, a shared system prompt and tool, scripted `tool_use` / `tool_result` turns,
/// streamed and not. Every later turn of an agent runs on its first turn's rank and reads its prefix from vLLM's
/// cache there (vLLM's own report, `cache_read_input_tokens`, at least the previous turn's prompt rounded down to
/// its 128-token blocks); the gateway's prompt and cached token counters are what vLLM reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdk_keeps_each_agent_on_its_rank() {
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let (gw, log) = gateway(engine, "anthropic", "", CACHE_AWARE, "");
    let python = common::python();
    let url = gw.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/anthropic_client.py"))
            .args([url.as_str(), "smollm2", "4", "4"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let turns: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(turns.len(), 16, "{stdout}");
    let prompt = |t: &Value| -> u64 {
        ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"]
            .iter()
            .map(|k| t[*k].as_u64().unwrap())
            .sum()
    };
    for session in 0..4 {
        let mine: Vec<&Value> = turns.iter().filter(|t| t["session"] == session).collect();
        assert!(prompt(mine[0]) > 300, "{stdout}");
        for pair in mine.windows(2) {
            assert_eq!(
                pair[1]["endpoint"], pair[0]["endpoint"],
                "session {session} left its rank:\n{stdout}"
            );
            let blocks = prompt(pair[0]) / 128 * 128;
            let read = pair[1]["cache_read_input_tokens"].as_u64().unwrap();
            assert!(
                read >= blocks,
                "session {session}: {read} cached of {blocks}:\n{stdout}"
            );
        }
    }
    let total: u64 = turns.iter().map(prompt).sum();
    let cached: u64 = turns
        .iter()
        .map(|t| t["cache_read_input_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(
        common::token_counters(&client(), &gw.url).await,
        (total, cached),
        "{stdout}"
    );
}

/// The least-squares line through `samples` (x, y): its slope.
fn least_squares_slope(samples: &[(f64, f64)]) -> f64 {
    let n = samples.len() as f64;
    let (mx, my) = (
        samples.iter().map(|s| s.0).sum::<f64>() / n,
        samples.iter().map(|s| s.1).sum::<f64>() / n,
    );
    let sxy: f64 = samples.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = samples.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    sxy / sxx
}

/// The gateway learns the CPU engine's prefill rate from its requests: ten streamed completions of about 50 to
/// 750 fresh prompt tokens, pinned to rank 0 one after another; an offline least-squares fit of the same requests'
/// time to first byte (measured at the client) against their uncached tokens (vLLM's usage) gives the rate
/// `/workers` must show within 25%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learned_prefill_rate_matches_an_offline_fit_of_the_same_requests() {
    use http_body_util::BodyExt;
    let _one = ENGINE.lock().await;
    let Some(engine) = cold_engine().await else { return };
    let (gw, _) = gateway(engine, "costs", "", "policy = \"cache_aware\"", "");
    let c = client();
    let mut samples = Vec::new();
    for i in 0..10u64 {
        let words: String = (0..40 + i * 60).map(|w| format!("item{} ", (w * 7 + i) % 97)).collect();
        let body = json!({"model": "smollm2", "prompt": format!("Request {i}: {words}"), "max_tokens": 1,
                          "stream": true, "stream_options": {"include_usage": true}});
        let started = std::time::Instant::now();
        let url = format!("{}/v1/completions", gw.url);
        let reply = common::send(&c, &url, &[("x-data-parallel-rank", "0")], body.to_string()).await;
        assert_eq!(reply.status(), StatusCode::OK);
        let mut stream = reply.into_body();
        let (mut first, mut text) = (None, Vec::new());
        while let Some(frame) = stream.frame().await {
            if let Some(data) = frame.unwrap().data_ref() {
                first = first.or((!data.is_empty()).then(|| started.elapsed()));
                text.extend_from_slice(data);
            }
        }
        let text = String::from_utf8(text).unwrap();
        let usage: Value = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
            .unwrap_or_else(|| panic!("no usage in {text}"));
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        samples.push(((prompt - cached) as f64, first.unwrap().as_secs_f64() * 1e6));
    }
    let offline = 1e6 / least_squares_slope(&samples);
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    let costs = &workers["workers"][0]["endpoints"][0]["prefill_costs"];
    let learned = costs["fitted"]["tokens_per_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("no fit: {costs}"));
    eprintln!("prefill rate: learned {learned:.1} tokens/s, offline {offline:.1}; samples {samples:?}");
    assert!(
        (learned / offline - 1.0).abs() < 0.25,
        "learned {learned} tokens/s against {offline} offline: {costs}, {samples:?}"
    );
}
