//! Prefill/decode disaggregation end to end, all real processes on loopback: mock engines in SGLang's PD roles
//! (`mock-engine --disaggregation-mode prefill|decode`) behind `dprouter serve --prefill … --decode …`, or behind a
//! real Envoy and `dprouter epp`, with `dprouter decode-sidecar` in front of each decode server running the prefill
//! leg where the picker names it (`x-prefiller-host-port`).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::envoy::Envoy;
use common::picker::Picker;
use common::{cached_tokens, eventually, get, in_flight, post, read, send, Proc};
use serde_json::{json, Value};

/// A prefill or decode mock with `dp` ranks; `extra` flags after.
fn mock(mode: &str, dp: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "--dp-size",
        dp,
        "--disaggregation-mode",
        mode,
        "--disaggregation-bootstrap-port",
        "0",
    ];
    args.extend_from_slice(extra);
    Proc::engine(&args)
}

/// A prefill mock's `--prefill` value: its URL and its bootstrap server's port.
async fn prefill_arg(c: &common::HttpClient, prefill: &Proc) -> String {
    let info = get(c, &format!("{}/get_server_info", prefill.url)).await.json;
    assert_eq!(info["disaggregation_mode"], "prefill");
    format!("{}:{}", prefill.url, info["disaggregation_bootstrap_port"])
}

/// Where clients send their requests.
#[derive(Clone, Copy, PartialEq)]
enum Door {
    /// `dprouter serve`.
    Serve,
    /// A real Envoy asking `dprouter epp`, with a `dprouter decode-sidecar` in front of each decode server.
    Envoy,
}

/// The front door in front of a P/D fleet, and what it runs on.
struct Front {
    /// Where clients send requests.
    url: String,
    /// The gateway's or the picker's HTTP side (`/workers`).
    admin: String,
    _procs: Vec<Proc>,
    _envoy: Option<Envoy>,
}

/// A front door of `door` in front of `prefills` and `decodes`, with `extra` flags for the gateway or picker
/// (`--backend vllm` among them: the prefill servers are then named without a bootstrap port, and the sidecars
/// pair the legs vLLM's way).
async fn gateway(c: &common::HttpClient, prefills: &[&Proc], decodes: &[&Proc], extra: &[&str]) -> Front {
    front(Door::Serve, c, prefills, decodes, extra).await
}

async fn front(door: Door, c: &common::HttpClient, prefills: &[&Proc], decodes: &[&Proc], extra: &[&str]) -> Front {
    let vllm = extra.contains(&"vllm");
    let mut procs = Vec::new();
    let mut owned = Vec::new();
    for p in prefills {
        owned.push("--prefill".to_string());
        owned.push(if vllm { p.url.clone() } else { prefill_arg(c, p).await });
    }
    for d in decodes {
        let url = match door {
            Door::Serve => d.url.clone(),
            Door::Envoy => {
                let backend = if vllm { "vllm" } else { "sglang" };
                let sidecar = Proc::start(&[
                    "decode-sidecar",
                    "--listen",
                    "127.0.0.1:0",
                    "--decode",
                    &d.url,
                    "--backend",
                    backend,
                    "--prefill-allow",
                    "127.0.0.1",
                ]);
                let url = sidecar.url.clone();
                procs.push(sidecar);
                url
            }
        };
        owned.push("--decode".to_string());
        owned.push(url);
    }
    let mut args: Vec<&str> = vec!["--poll-load-ms", "50"];
    args.extend(owned.iter().map(String::as_str));
    args.extend_from_slice(extra);
    match door {
        Door::Serve => {
            let mut serve = vec!["serve", "--listen", "127.0.0.1:0"];
            serve.extend(args);
            let gw = Proc::start(&serve);
            let url = gw.url.clone();
            procs.push(gw);
            Front {
                url: url.clone(),
                admin: url,
                _procs: procs,
                _envoy: None,
            }
        }
        Door::Envoy => {
            let picker = Picker::start(&[], &args);
            let name = format!("pd-{}", picker.grpc.rsplit(':').next().unwrap());
            let envoy = Envoy::start(&name, &[&picker.grpc]).await;
            envoy.wait_for_healthy_pickers(1).await;
            procs.push(picker.proc);
            Front {
                url: envoy.url.clone(),
                admin: procs.last().unwrap().url.clone(),
                _procs: procs,
                _envoy: Some(envoy),
            }
        }
    }
}

/// Agent `agent`'s prompt at turn `turn`: its own 3,000-token system prompt, then 48 tokens per earlier turn.
fn prompt(agent: u32, turn: u32) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..3000).map(|i| 1000 + agent * 100_000 + i).collect();
    ids.extend((0..turn * 48).map(|i| 50_000 + agent * 100_000 + i));
    ids
}

/// Open bootstrap rooms and requests on all ranks of a mock.
async fn mock_load(c: &common::HttpClient, engine: &Proc) -> (u64, u64) {
    let info = get(c, &format!("{}/get_server_info", engine.url)).await.json;
    let load = get(c, &format!("{}/get_load", engine.url)).await.json;
    let requests = load
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["num_reqs"].as_u64().unwrap())
        .sum();
    (info["open_bootstrap_rooms"].as_u64().unwrap(), requests)
}

/// Nothing left anywhere: no request in flight at the gateway, no room or request at a mock.
async fn all_settled(c: &common::HttpClient, gateway: &Front, engines: &[&Proc]) -> bool {
    eventually(Duration::from_secs(10), || async {
        if in_flight(c, &gateway.admin).await != 0 {
            return false;
        }
        for e in engines {
            if mock_load(c, e).await != (0, 0) {
                return false;
            }
        }
        true
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_hit_their_prefill_cache_while_decode_load_is_spread() {
    agents(Door::Serve, &[], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_hit_their_prefill_cache_through_vllms_two_steps() {
    agents(
        Door::Serve,
        &["--api", "vllm"],
        &["--backend", "vllm", "--dp-size", "2"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_hit_their_prefill_cache_through_envoy_the_picker_and_decode_sidecars() {
    agents(Door::Envoy, &[], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_hit_their_prefill_cache_through_envoy_and_vllms_two_steps() {
    agents(
        Door::Envoy,
        &["--api", "vllm"],
        &["--backend", "vllm", "--dp-size", "2"],
    )
    .await;
}

/// Turn `n` of agent `agent` at `url`: its prompt's tokens, the tokens cached, its prefill and decode endpoints.
async fn turn(c: &common::HttpClient, url: &str, agent: u32, n: u32) -> (u64, u64, String, String) {
    let ids = prompt(agent, n);
    let stream = (agent + n) % 2 == 1;
    let body = json!({"model": "m", "prompt": ids, "max_tokens": 8, "stream": stream,
                      "stream_options": {"include_usage": true}});
    let reply = post(c, url, &[], &body).await;
    assert_eq!(reply.status, 200, "agent {agent} turn {n}: {}", reply.text);
    let prefill = reply.headers["x-dprouter-prefill-endpoint"]
        .to_str()
        .unwrap()
        .to_string();
    let decode = reply.endpoint.clone().unwrap();
    let cached = cached_tokens(&reply).unwrap_or_else(|| panic!("no usage in {}", reply.text));
    if stream {
        assert!(reply.text.contains("data: [DONE]"), "{}", reply.text);
    }
    (ids.len() as u64, cached, prefill, decode)
}

/// Four agents of four turns each through two prefill and two decode mocks with DP 2 (`api` their flags) behind a
/// front door of `door` (with `flags`).
async fn agents(door: Door, api: &[&str], flags: &[&str]) {
    let c = common::client();
    let (p1, p2) = (mock("prefill", "2", api), mock("prefill", "2", api));
    let (d1, d2) = (mock("decode", "2", api), mock("decode", "2", api));
    let gw = front(door, &c, &[&p1, &p2], &[&d1, &d2], flags).await;

    let url = format!("{}/v1/completions", gw.url);
    // The agents' first turns one after another: a later turn then never finds its prefill endpoint busy with
    // another agent's whole cold prompt (where computing its own prompt again elsewhere is as quick, and the
    // policy may rightly take it).
    let mut first_turns = Vec::new();
    for agent in 0..4u32 {
        first_turns.push(turn(&c, &url, agent, 0).await);
    }
    let agents = first_turns.into_iter().zip(0..4u32).map(|(first, agent)| {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            let mut turns = vec![first];
            for n in 1..4u32 {
                turns.push(turn(&c, &url, agent, n).await);
            }
            turns
        })
    });
    let mut decode_tokens: BTreeMap<String, u64> = BTreeMap::new();
    let mut prefills = std::collections::BTreeSet::new();
    for (agent, task) in agents.enumerate() {
        let turns = task.await.unwrap();
        for (turn, (tokens, cached, prefill, decode)) in turns.iter().enumerate() {
            if turn > 0 {
                assert!(
                    2 * cached > *tokens,
                    "agent {agent} turn {turn}: {cached} of {tokens} tokens cached on {prefill}"
                );
                assert_eq!(prefill, &turns[0].2, "agent {agent} left its prefill endpoint");
            }
            *decode_tokens.entry(decode.clone()).or_default() += tokens;
        }
        prefills.insert(turns[0].2.clone());
    }
    // Each decode rank is an endpoint of a decode worker (workers 2 and 3: the prefill ones come first).
    assert!(
        decode_tokens.keys().all(|e| e.starts_with("w2") || e.starts_with("w3")),
        "{decode_tokens:?}"
    );
    assert_eq!(decode_tokens.len(), 4, "every decode rank serves: {decode_tokens:?}");
    let total: u64 = decode_tokens.values().sum();
    let busiest = *decode_tokens.values().max().unwrap();
    assert!(
        busiest as f64 <= 1.5 * total as f64 / 4.0,
        "decode tokens per rank: {decode_tokens:?}"
    );
    assert!(
        prefills.len() > 1,
        "the agents share one prefill endpoint: {prefills:?}"
    );
    // Every decode leg took its KV cache from its prefill leg.
    let mut transfers = 0;
    for d in [&d1, &d2] {
        transfers += get(&c, &format!("{}/get_server_info", d.url)).await.json["kv_transfers"]
            .as_u64()
            .unwrap();
    }
    assert_eq!(transfers, 16);
    assert!(
        all_settled(&c, &gw, &[&p1, &p2, &d1, &d2]).await,
        "something was left in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_leg_gives_a_clear_error_and_leaves_no_decode_leg_waiting() {
    failing_prefill(Door::Serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_leg_behind_envoy_gives_a_clear_error_and_leaves_no_decode_leg_waiting() {
    failing_prefill(Door::Envoy).await;
}

async fn failing_prefill(door: Door) {
    let c = common::client();
    let failing = mock("prefill", "2", &["--error-rate", "1"]);
    let decode = mock("decode", "2", &[]);
    let gw = front(door, &c, &[&failing], &[&decode], &[]).await;
    for stream in [false, true, false, false] {
        let body = json!({"prompt": prompt(0, 0), "max_tokens": 4, "stream": stream});
        let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
        // A stream's head may come from the decode server before the prefill leg fails: the stream then ends with
        // the error event instead (and no `[DONE]`).
        let error = match reply.status.as_u16() {
            502 => reply.json["error"].clone(),
            200 if stream => {
                assert!(!reply.text.contains("[DONE]"), "{}", reply.text);
                let event = reply.text.lines().rev().find_map(|l| l.strip_prefix("data: ")).unwrap();
                serde_json::from_str::<Value>(event).unwrap()["error"].clone()
            }
            other => panic!("{other}: {}", reply.text),
        };
        let message = error["message"].as_str().unwrap();
        assert_eq!(error["code"], 502, "{error}");
        assert!(message.contains("prefill leg") && message.contains("500"), "{message}");
    }
    // The failures count against the prefill endpoint (three in a row eject it), never the decode one.
    let workers = get(&c, &format!("{}/workers", gw.admin)).await.json;
    let ejections = |worker: usize| -> u64 {
        let endpoints = workers["workers"][worker]["endpoints"].as_array().unwrap();
        endpoints.iter().map(|e| e["ejections"].as_u64().unwrap()).sum()
    };
    assert!(ejections(0) >= 1, "{workers}");
    assert_eq!(ejections(1), 0, "{workers}");
    assert!(
        all_settled(&c, &gw, &[&failing, &decode]).await,
        "something was left in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_that_never_answers_fails_the_request_and_frees_the_room() {
    let c = common::client();
    let hanging = mock("prefill", "1", &["--bootstrap-hangs"]);
    let decode = mock("decode", "1", &["--disaggregation-timeout-s", "0.5"]);
    let gw = gateway(&c, &[&hanging], &[&decode], &[]).await;
    let body = json!({"prompt": prompt(1, 0), "max_tokens": 4});
    let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
    assert_eq!(reply.status, 500, "{}", reply.text);
    assert!(reply.text.contains("KV transfer"), "{}", reply.text);
    assert!(
        all_settled(&c, &gw, &[&hanging, &decode]).await,
        "something was left in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_cancels_both_legs() {
    hang_up(Door::Serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_on_envoy_cancels_both_legs() {
    hang_up(Door::Envoy).await;
}

async fn hang_up(door: Door) {
    let c = common::client();
    // Slow decoding: the answer is still streaming when the client goes.
    let prefill = mock("prefill", "1", &[]);
    let decode = mock("decode", "1", &["--tpot-ms", "200"]);
    let gw = front(door, &c, &[&prefill], &[&decode], &[]).await;
    let body = json!({"prompt": prompt(2, 0), "max_tokens": 50, "stream": true});
    let mut response = send(&c, &format!("{}/v1/completions", gw.url), &[], body.to_string()).await;
    assert_eq!(response.status(), 200);
    // Its first token read, the decode leg is decoding (not still fetching the prefill's KV cache): the client goes.
    let first = http_body_util::BodyExt::frame(response.body_mut()).await;
    assert!(matches!(first, Some(Ok(_))), "no first event");
    drop(response);
    assert!(
        all_settled(&c, &gw, &[&prefill, &decode]).await,
        "something was left in flight"
    );
    let aborted = get(&c, &format!("{}/get_server_info", decode.url)).await.json["aborted_requests"].clone();
    assert_eq!(aborted, 1, "the decode leg was not cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mocks_refuse_what_sglang_refuses() {
    let c = common::client();
    let prefill = mock("prefill", "2", &[]);
    let decode = mock("decode", "2", &[]);
    let ids = prompt(3, 0);
    // No room.
    for engine in [&prefill, &decode] {
        let reply = post(&c, &format!("{}/generate", engine.url), &[], &json!({"input_ids": ids})).await;
        assert_eq!(reply.status, 400);
        assert!(reply.text.contains("without bootstrap room id"), "{}", reply.text);
    }
    // A pin that disagrees with the room's residue.
    let body = json!({"input_ids": ids, "bootstrap_room": 7, "routed_dp_rank": 0});
    let reply = post(&c, &format!("{}/generate", prefill.url), &[], &body).await;
    assert_eq!(reply.status, 400);
    assert!(reply.text.contains("follow_bootstrap_room"), "{}", reply.text);
    // The two legs of one room, by hand: the decode server names the wrong prefill rank, then the right one.
    let bootstrap =
        get(&c, &format!("{}/get_server_info", prefill.url)).await.json["disaggregation_bootstrap_port"].clone();
    let leg = |rank: u32| {
        json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 3}, "bootstrap_room": 9,
               "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "disagg_prefill_dp_rank": rank})
    };
    let prefill_leg = tokio::spawn({
        let (c, url, body) = (c.clone(), format!("{}/generate", prefill.url), leg(1));
        async move { read(send(&c, &url, &[], body.to_string()).await).await }
    });
    let wrong = post(&c, &format!("{}/generate", decode.url), &[], &leg(0)).await;
    assert_eq!(wrong.status, 500);
    assert!(wrong.text.contains("not 0"), "{}", wrong.text);
    let right = post(&c, &format!("{}/generate", decode.url), &[], &leg(1)).await;
    assert_eq!(right.status, 200, "{}", right.text);
    assert_eq!(right.json["meta_info"]["completion_tokens"], 3);
    let prefill_reply = prefill_leg.await.unwrap();
    assert_eq!(prefill_reply.status, 200, "{}", prefill_reply.text);
    assert_eq!(
        prefill_reply.json["meta_info"]["dp_rank"], 1,
        "room 9 goes to rank 9 % 2"
    );
    assert_eq!(prefill_reply.json["meta_info"]["completion_tokens"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_vllm_prefill_leaves_the_decode_server_to_prefill() {
    let c = common::client();
    let failing = mock("prefill", "1", &["--api", "vllm", "--error-rate", "1"]);
    let decode = mock("decode", "1", &["--api", "vllm"]);
    let gw = gateway(&c, &[&failing], &[&decode], &["--backend", "vllm"]).await;
    for stream in [false, true] {
        let body = json!({"prompt": prompt(5, 0), "max_tokens": 4, "stream": stream});
        let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    // The decode server prefilled the prompt itself: the second time it had it cached.
    let body = json!({"prompt": prompt(5, 0), "max_tokens": 4});
    let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
    assert!(cached_tokens(&reply).unwrap() > 2900, "{}", reply.text);
    assert!(
        all_settled(&c, &gw, &[&failing, &decode]).await,
        "something was left in flight"
    );
    // With no prefill server at all (its connection refused, then marked down), the decode server serves alone.
    let mut failing = failing;
    failing.kill();
    for _ in 0..3 {
        let reply = post(&c, &format!("{}/v1/completions", gw.url), &[], &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    assert_eq!(in_flight(&c, &gw.admin).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_request_with_little_left_to_prefill_goes_to_its_decode_server_alone() {
    let c = common::client();
    let prefill = mock("prefill", "1", &["--api", "vllm"]);
    let decode = mock("decode", "1", &["--api", "vllm"]);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("disaggregation");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("conditional.toml");
    std::fs::write(
        &config,
        "[decode_routing]\npolicy = \"cache_aware\"\n\n[disaggregation]\nlocal_prefill_below_tokens = 1000\nlocal_prefill_max_share = 0.7\n",
    )
    .unwrap();
    let gw = gateway(
        &c,
        &[&prefill],
        &[&decode],
        &["--backend", "vllm", "--config", config.to_str().unwrap()],
    )
    .await;
    let url = format!("{}/v1/completions", gw.url);
    let prefilled_by = |reply: &common::Reply| reply.headers.get("x-dprouter-prefill-endpoint").is_some();
    // Turn 0: nothing cached on the decode server, 3,000 tokens to prefill: both legs.
    let reply = post(&c, &url, &[], &json!({"prompt": prompt(7, 0), "max_tokens": 4})).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(prefilled_by(&reply));
    // Turn 1: the decode server holds turn 0's 3,000 tokens (its KV came from the prefill server): 48 are left,
    // under 1,000 and under 70% of the prompt. It prefills them itself.
    let reply = post(
        &c,
        &url,
        &[],
        &json!({"prompt": prompt(7, 1), "max_tokens": 4, "stream": true}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(!prefilled_by(&reply), "{:?}", reply.headers);
    // A short new prompt: 200 tokens, under 1,000 but all of the prompt: both legs.
    let short: Vec<u32> = (0..200).map(|i| 900_000 + i).collect();
    let reply = post(&c, &url, &[], &json!({"prompt": short, "max_tokens": 4})).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(prefilled_by(&reply));
    assert!(
        all_settled(&c, &gw, &[&prefill, &decode]).await,
        "something was left in flight"
    );
}

/// The sidecar behind another picker (llm-d's EPP names only the prefill endpoint): it draws the room and names the
/// prefill server's address and its `--bootstrap-port`; a header that is no `ip:port` is refused; other requests go
/// to the decode server as they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_sidecar_pairs_the_legs_of_a_request_another_picker_sent() {
    let c = common::client();
    // One prefill rank: a room drawn at random names any rank of the prefill server.
    let prefill = mock("prefill", "1", &[]);
    let decode = mock("decode", "1", &[]);
    let bootstrap = prefill_arg(&c, &prefill).await.rsplit(':').next().unwrap().to_string();
    let sidecar = Proc::start(&[
        "decode-sidecar",
        "--listen",
        "127.0.0.1:0",
        "--decode",
        &decode.url,
        "--bootstrap-port",
        &bootstrap,
        "--prefill-allow",
        "127.0.0.0/8",
    ]);
    let at = prefill.url.trim_start_matches("http://");
    let url = format!("{}/v1/completions", sidecar.url);
    for stream in [false, true] {
        let body = json!({"prompt": prompt(8, 0), "max_tokens": 4, "stream": stream,
                          "stream_options": {"include_usage": true}});
        let reply = post(&c, &url, &[("x-prefiller-host-port", at)], &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    // The second time the prefill server had the prompt cached, and the decode server took both KV transfers.
    let body = json!({"prompt": prompt(8, 0), "max_tokens": 4});
    let reply = post(&c, &url, &[("x-prefiller-host-port", at)], &body).await;
    assert!(cached_tokens(&reply).unwrap() > 2900, "{}", reply.text);
    let info = get(&c, &format!("{}/get_server_info", sidecar.url)).await;
    assert_eq!(info.json["disaggregation_mode"], "decode", "{}", info.text);
    assert_eq!(info.json["kv_transfers"], 3);
    let bad = post(&c, &url, &[("x-prefiller-host-port", "prefill-0:8000")], &body).await;
    assert_eq!(bad.status, 400, "{}", bad.text);
    assert!(
        bad.json["error"]["message"].as_str().unwrap().contains("ip:port"),
        "{}",
        bad.text
    );
    // Without the header the decode server gets the request alone, and refuses it as SGLang does (no room).
    let alone = post(&c, &url, &[], &body).await;
    assert_eq!(alone.status, 400, "{}", alone.text);
    assert!(alone.text.contains("without bootstrap room id"), "{}", alone.text);
    for engine in [&prefill, &decode] {
        assert_eq!(mock_load(&c, engine).await, (0, 0));
    }
}
